"""A whole deployment on this machine, started and stopped by the bench:
private Redis, Celery CPU workers, a GPU worker, gunicorn API; and the serial
baseline beside it. Both get the same model spec and device."""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import requests
import yaml

from bench.stack.cpu import CpuScope
from bench.stack.processes import (
    REPO_ROOT,
    ManagedProcess,
    RedisServer,
    api_argv,
    callback_worker_argv,
    cpu_worker_argv,
    free_port,
    gpu_worker_argv,
    python_argv,
    wait_until,
)
from tools.redis_ha import AOF_AS_DEPLOYED

if TYPE_CHECKING:
    from tools.redis_ha import RedisHA


def api_env(port: int, workers: int | None = None, threads: int | None = None) -> dict[str, str]:
    """The API's address and size (IMGSERVE_API__*). `bench ab` runs an older checkout beside this one: one
    from before these names (0.1.0's IMGSERVE_API_BIND, ...) cannot be compared this way any more."""
    env = {"IMGSERVE_API__BIND": f"127.0.0.1:{port}"}
    if workers is not None:
        env["IMGSERVE_API__WORKERS"] = str(workers)
    if threads is not None:
        env["IMGSERVE_API__THREADS"] = str(threads)
    return env


@dataclass
class StackOptions:
    device: str = "sim"
    cpu_workers: int | None = 2  # None: the Procfile's own default (make run's stack only)
    max_batch_size: int = 8
    window_ms: float = 12.0
    api_workers: int = 2
    api_threads: int = 128
    persistent_redis: bool = False
    sim_profile_ms: dict[int, float] | None = None  # device sim: its latency profile (None: the config's)
    redis_args: tuple[str, ...] = ()  # more redis-server options, e.g. ("--io-threads", "2")
    bulk_shards: int = 0  # uploads and frames on this many more servers (contract.redis.shards)
    root: Path = REPO_ROOT  # the checkout the stack's processes run from
    # ProcfileStack: "run-local" starts it as `make run` does (scripts/run-local: settings read, bootstrap checked,
    # the supervisor with its readiness line); "procfile": the supervisor alone (bench ab: an older checkout,
    # whose run-local may have been broken, and which has no .venv of its own)
    launcher: str = "run-local"
    # ProcfileStack: the control plane behind Sentinel (tools.redis_ha: a primary, two replicas, three Sentinels),
    # as `make run REDIS=sentinel` runs it; every 202 then waits for a replica (settings.redis)
    sentinel: bool = False
    # A plain control plane with an append-only file fsynced every second, as make run's and compose's Redis (and
    # tools.redis_ha's nodes) keep one: bench ab sets it on the plain side of a Sentinel pair, so that the pair
    # differs by the replicas and WAIT alone, not by the file too
    control_plane_aof: bool = False
    callback_worker: bool = False  # a callback worker too, as the Procfile runs it
    cpu_worker_args: tuple[str, ...] = ()  # more `celery worker` options, e.g. --max-memory-per-child
    env: dict[str, str] = field(default_factory=dict)  # ProcfileStack: more environment (CPU_AUTOSCALE, ...)
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        workers = self.cpu_workers if self.cpu_workers is not None else "Procfile's"
        profile = (
            ""
            if self.sim_profile_ms is None or self.device != "sim"
            else " sim_ms=" + ",".join(f"{size}:{ms:g}" for size, ms in sorted(self.sim_profile_ms.items()))
        )
        return (
            f"device={self.device} cpu_workers={workers} max_batch={self.max_batch_size} "
            f"window_ms={self.window_ms:g}{profile}"
        )

    def config(self, redis_url: str, shard_urls: list[str] | None = None) -> dict[str, Any]:
        """The config file the stack's processes read: these options, then `extra` over them by section."""
        gpu_worker: dict[str, Any] = {"device": self.device}
        if self.sim_profile_ms is not None:
            gpu_worker["sim_latency_ms"] = dict(self.sim_profile_ms)
        config: dict[str, Any] = {
            "redis_url": redis_url,
            "gpu_worker": gpu_worker,
            "batching": {"max_batch_size": self.max_batch_size, "window_ms": self.window_ms},
        }
        if shard_urls:
            config["bulk"] = {"redis_urls": list(shard_urls)}
        for section, value in self.extra.items():
            both_sections = isinstance(value, dict) and isinstance(config.get(section), dict)
            config[section] = {**config[section], **value} if both_sections else value
        return config


def _laid_over(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over`'s sections merged into `base`'s, key by key."""
    merged = dict(base)
    for section, value in over.items():
        both = isinstance(value, dict) and isinstance(merged.get(section), dict)
        merged[section] = {**merged[section], **value} if both else value
    return merged


def start_shards(workdir: Path, options: StackOptions) -> list[RedisServer]:
    """The stack's bulk shards: redis-servers of their own, in folders of their own."""
    shards = []
    for index in range(options.bulk_shards):
        folder = workdir / f"shard{index}"
        folder.mkdir(exist_ok=True)
        shards.append(RedisServer(folder, persistent=options.persistent_redis, extra_args=options.redis_args))
    return shards


def answers_ok(url: str, processes: list[ManagedProcess]) -> bool:
    """True once `url` answers 200; an error if one of the processes behind it died meanwhile."""
    dead = [p for p in processes if not p.alive()]
    if dead:
        raise RuntimeError(f"{dead[0].name} died:\n{dead[0].log_tail()}")
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


class LocalStack:
    def __init__(self, workdir: Path, options: StackOptions) -> None:
        self.workdir = workdir
        self.options = options
        self.processes: list[ManagedProcess] = []
        self.redis: RedisServer | None = None
        self.shards: list[RedisServer] = []
        self.url = ""
        self.argv: dict[str, list[str]] = {}
        self.env: dict[str, str] = {}

    def start(self) -> LocalStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(
            self.workdir, persistent=self.options.persistent_redis, extra_args=self.options.redis_args
        )
        self.shards = start_shards(self.workdir, self.options)
        config_path = self.workdir / "config.yaml"
        shard_urls = [shard.url for shard in self.shards]
        config_path.write_text(yaml.safe_dump(self.options.config(self.redis.url, shard_urls)))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "IMGSERVE_CONFIG": str(config_path),
            "PYTHONUNBUFFERED": "1",
            **api_env(port, self.options.api_workers, self.options.api_threads),
        }
        env.pop("IMGSERVE_REDIS_URL", None)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self._spawn(
            "cpu-worker",
            cpu_worker_argv(cast(int, self.options.cpu_workers), *self.options.cpu_worker_args),
            env,
        )
        if self.options.callback_worker:
            self._spawn(
                "callback-worker",
                callback_worker_argv(16),
                env,
            )
        self._spawn(
            "gpu-worker",
            gpu_worker_argv(self.options.device, "bench-gpu"),
            env,
        )
        self._spawn(
            "api",
            api_argv(access_log=False),
            env,
        )
        wait_until(self._ready, 120, interval_s=0.2, what=f"the stack at {self.url} to be ready")
        return self

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.processes.append(ManagedProcess(name, argv, env, self.workdir, root=self.options.root))
        self.argv[name], self.env = argv, env

    def cpu_scope(self) -> CpuScope:
        """This stack's processes (their sessions) and its Redis, for CPU per image."""
        return CpuScope(
            self.redis.port if self.redis else None,
            frozenset(p.process.pid for p in self.processes if p.alive()),
            tuple(shard.port for shard in self.shards),
        )

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in reversed(self.processes) if p.name == name)

    def restart(self, name: str) -> ManagedProcess:
        """Start the named role again (after it was killed), with its original command."""
        self.processes.append(ManagedProcess(name, self.argv[name], self.env, self.workdir, root=self.options.root))
        return self.processes[-1]

    def _ready(self) -> bool:
        return answers_ok(self.url + "/readyz", self.processes)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        if self.redis:
            self.redis.stop()
        for shard in self.shards:
            shard.stop()


class BaselineServer:
    """The serial baseline as its own process, on the same model and device."""

    def __init__(self, workdir: Path, device: str) -> None:
        self.workdir = workdir
        self.device = device
        self.process: ManagedProcess | None = None
        self.url = ""

    def start(self) -> BaselineServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = ManagedProcess(
            "baseline", python_argv("-m", "baseline", "--device", self.device, "--port", str(port)), env, self.workdir
        )
        process = self.process
        wait_until(
            lambda: answers_ok(self.url + "/healthz", [process]), 120, interval_s=0.2, what="the baseline server"
        )
        return self

    def cpu_scope(self) -> CpuScope:
        return CpuScope(None, frozenset({self.process.process.pid}) if self.process else frozenset())

    def stop(self) -> None:
        if self.process:
            self.process.stop()


class ProcfileStack:
    """Exactly what `make run` runs (scripts/run-local: the Procfile under tools.procfile: API, CPU workers,
    callback worker, GPU worker, Flower), on a private Redis and free ports, so bench figures are what its users
    see, and every bench or test of this stack goes through make run's own script."""

    def __init__(self, workdir: Path, options: StackOptions) -> None:
        self.workdir = workdir
        self.options = options
        self.redis: RedisServer | None = None
        self.ha: RedisHA | None = None
        self.redis_url = ""
        self.shards: list[RedisServer] = []
        self.supervisor: ManagedProcess | None = None
        self.url = ""
        self.env: dict[str, str] = {}

    def start(self) -> ProcfileStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._control_plane()
        self.shards = start_shards(self.workdir, self.options)
        config_path = self.workdir / "config.yaml"
        shard_urls = [shard.url for shard in self.shards]
        config_path.write_text(yaml.safe_dump(_laid_over(self.options.config(self.redis_url, shard_urls), config)))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        metrics_dir = self.workdir / "prometheus"
        metrics_dir.mkdir(exist_ok=True)
        env = {
            **os.environ,
            "IMGSERVE_CONFIG": str(config_path),
            **api_env(port),
            **({"CPU_WORKERS": str(self.options.cpu_workers)} if self.options.cpu_workers else {}),
            "FLOWER_PORT": str(free_port()),
            "FLOWER_BASIC_AUTH": f"flower:{secrets.token_urlsafe(18)}",
            "GPU_METRICS_PORT": str(free_port()),
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            **self.options.env,
        }
        env.pop("IMGSERVE_REDIS_URL", None)
        self.env = env
        argv = (
            [str(self.options.root / "scripts" / "run-local")]
            if self.options.launcher == "run-local"
            else [sys.executable, "-m", "tools.procfile", "Procfile"]
        )
        supervisor = self.supervisor = ManagedProcess("procfile", argv, env, self.workdir, root=self.options.root)
        wait_until(
            lambda: answers_ok(self.url + "/readyz", [supervisor]),
            180,
            interval_s=0.3,
            what=f"make run's processes at {self.url} to be ready",
        )
        return self

    def _control_plane(self) -> dict[str, Any]:
        """A private redis-server, or (options.sentinel) a primary, a replica and three Sentinels: the settings
        that point the stack's processes at it."""
        if not self.options.sentinel:
            aof = AOF_AS_DEPLOYED if self.options.control_plane_aof else ()
            self.redis = RedisServer(
                self.workdir, persistent=self.options.persistent_redis, extra_args=(*aof, *self.options.redis_args)
            )
            self.redis_url = self.redis.url
            return {}
        from tools.redis_ha import RedisHA

        self.ha = RedisHA(self.workdir / "redis-ha").start()
        self.redis_url = "redis://127.0.0.1:6379/0"  # with Sentinels, only its database and password count
        return {"redis": {"sentinels": self.ha.sentinels, "service": self.ha.service}}

    def control_plane_port(self) -> int | None:
        """The port of the Redis that holds the control plane now (the primary, with Sentinels)."""
        if self.ha is not None:
            primary = self.ha.primary()
            return self.ha.nodes[primary].port if primary else None
        return self.redis.port if self.redis else None

    def cpu_scope(self) -> CpuScope:
        primary = self.control_plane_port()
        others: tuple[tuple[int, str], ...] = ()
        if self.ha is not None:  # the replicas and the Sentinels are the failover's cost: counted as roles
            others = tuple(
                (node.port, "redis-sentinel" if name.startswith("s") else "redis-replica")
                for name, node in self.ha.nodes.items()
                if node.port != primary
            )
        return CpuScope(
            primary,
            frozenset({self.supervisor.process.pid}) if self.supervisor else frozenset(),
            tuple(shard.port for shard in self.shards),
            others,
        )

    def stop(self) -> None:
        if self.supervisor:
            self.supervisor.stop(timeout_s=40)
        if self.redis:
            self.redis.stop()
        if self.ha is not None:
            self.ha.stop()
        for shard in self.shards:
            shard.stop()
