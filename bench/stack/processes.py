"""Real processes on this machine: a private redis-server, and children whose
output goes to log files. Used by the bench's local stacks and by the tests."""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis

from tools.redis_config import redis_config_args

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.05, what: str = "condition"
) -> T:
    """Poll with a deadline; the value of the first truthy call, else AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


# Below Linux's ephemeral range (32768-60999): a port the kernel hands out for bind(0) is also what it hands the
# next outgoing connection, which may take it before our server binds it ("address in use", seen as a flake).
# Each xdist worker draws from a band of its own, so two workers never race for one port; within a process the
# ports go round the band from a random start, so two calls before either port is bound never get the same one,
# in strides: make run CELLS=N takes the ports after the ones it is given (a cell's Flower at FLOWER_PORT + 1).
PORT_BAND = 1500
PORT_FLOOR = 20000
PORT_STRIDE = 37  # coprime with PORT_BAND: the whole band, nearby ports only hundreds of draws apart
_next_in_band = itertools.count(secrets.randbelow(PORT_BAND))


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    band = PORT_FLOOR + (int(worker) if worker.isdigit() else 0) % 8 * PORT_BAND
    for _ in range(PORT_BAND):
        port = band + next(_next_in_band) * PORT_STRIDE % PORT_BAND
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {band}-{band + PORT_BAND}")


class RedisServer:
    """A private redis-server on a free port. Persistent: an append-only file
    fsynced on every write, so a stop and a restart lose nothing."""

    def __init__(
        self,
        workdir: Path,
        persistent: bool = False,
        extra_args: tuple[str, ...] = (),
        wrapper: tuple[str, ...] = (),
        root: Path = REPO_ROOT,
    ) -> None:
        """`extra_args`: more of redis-server's options, e.g. ("--io-threads", "2"). `wrapper`: a command it runs
        under (bench plane's valgrind, which counts its instructions). `root`: the checkout whose
        configs/redis.conf it runs with, as deployed (an older checkout's, which may have none, for an A/B run)."""
        self.wrapper = list(wrapper)
        self.config = redis_config_args(root)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.persistence = ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
        self.extra_args = list(extra_args)
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                *self.wrapper,
                "redis-server",
                *self.config,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *self.persistence,
                "--dir",
                str(self.workdir),
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        client = redis.Redis(port=self.port)
        wait_until(lambda: _pings(client), 60 if self.wrapper else 10, what="redis-server to answer")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def stop_together(processes: list[ManagedProcess], sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> list[int]:
    """Signal every process first, then wait for each (SIGKILL past `timeout_s`): their graceful
    shutdowns overlap instead of adding up. Their exit statuses, in order."""
    signalled = [process.signal(sig) for process in processes]
    deadline = time.monotonic() + timeout_s
    return [process._reap(sent, max(0.0, deadline - time.monotonic())) for process, sent in zip(processes, signalled)]


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def with_checkout_on_path(env: dict[str, str], root: Path = REPO_ROOT) -> dict[str, str]:
    """The service's packages run from the checkout, not from site-packages: celery and gunicorn are
    console scripts, so they find `tasks` and `app` only through PYTHONPATH."""
    inherited = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path and path != str(REPO_ROOT)]
    paths = [str(root), *inherited]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


class ManagedProcess:
    """A real child process in its own session, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, root: Path = REPO_ROOT) -> None:
        """`root`: the checkout it runs from (the bench's A/B runs an older one beside this one)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            argv,
            cwd=root,
            env=with_checkout_on_path(env, root),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        return stop_together([self], sig, timeout_s)[0]

    def signal(self, sig: int) -> bool:
        """Send `sig` to its whole session (a pool's children too); False when it had already ended."""
        if not self.alive():
            return False
        os.killpg(self.process.pid, sig)
        return True

    def _reap(self, signalled: bool, timeout_s: float) -> int:
        if signalled:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self._log.close()
        return self.process.returncode

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "tasks.worker", *args]


# How each role is started, in one place (the Procfile's lines, less what a bench's or a test's stack does not need):
# the benches, the tests and the netns harness build their processes' command lines here.


def api_argv(*more: str, access_log: bool = True) -> list[str]:
    """The API as the Procfile runs it: gunicorn with configs/gunicorn.conf.py (its bind and workers from the
    environment); `access_log` False: none written; `more`: further gunicorn options."""
    quiet = ("--access-logfile", "/dev/null") if not access_log else ()
    return python_argv("-m", "gunicorn", "-c", "configs/gunicorn.conf.py", *quiet, *more, "app:create_app()")


def gpu_worker_argv(device: str, worker_id: str, models: tuple[str, ...] = ()) -> list[str]:
    """A GPU worker on `device` as `worker_id`, for every configured model or only `models`."""
    return python_argv(
        "-m",
        "gpu_worker",
        "--device",
        device,
        "--worker-id",
        worker_id,
        *[arg for m in models for arg in ("--model", m)],
    )


def cpu_worker_argv(concurrency: int, *more: str, loglevel: str = "WARNING") -> list[str]:
    """A CPU worker on the preprocess queues, prefork, without gossip and mingle (a bench's or a test's stack:
    nothing there needs them); `more`: further `celery worker` options (a later `-c` wins)."""
    return celery_argv(
        "worker",
        "-Q",
        "preprocess",
        "-c",
        str(concurrency),
        "--without-gossip",
        "--without-mingle",
        "--loglevel",
        loglevel,
        *more,
    )


def callback_worker_argv(concurrency: int = 4) -> list[str]:
    """A callback worker on a thread pool, as the Procfile runs one, without gossip and mingle (a test's or the
    bench's stack: nothing there needs them)."""
    return celery_argv(
        "worker",
        "-Q",
        "callbacks",
        "-P",
        "threads",
        f"--concurrency={concurrency}",
        "--without-gossip",
        "--without-mingle",
        "--loglevel",
        "INFO",
    )


def status_kb(pid: int, field: str = "VmRSS") -> int | None:
    """A memory figure of a process from /proc/<pid>/status, in kB (VmRSS: resident now; VmHWM: its peak); None
    when the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith(f"{field}:")), None)


def children_of(pid: int) -> set[int]:
    """The live child processes of `pid`, zombies left out (from /proc)."""
    children = set()
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.add(int(status.parent.name))
    return children
