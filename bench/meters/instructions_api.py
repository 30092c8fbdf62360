"""`bench instructions --role api`: the API worker's instructions a submit and its poll, two ways.

- `count_api` (the figure since issue 52): two runs of the whole worker, N1 and N2 pairs, differenced. What both
  runs share (start-up, imports) cancels out; what the worker does each second whatever it serves (each cell's
  listener tick: the deadline sweep, the idle connections' close, the clock) does not: it counts for the runs'
  lengths, and under valgrind a run's start alone moves by 10 s or more from run to run. At the worker's ~4 M
  instructions a second idle, that is ±0.5 M a pair (±5%).
- `count_api_marked` (`--cells`, `--marked`): one run, counted between callgrind marks in the worker: a few pairs
  to warm it, then `idle_s` seconds with nothing to do (its idle rate), then the pairs, timed. A pair's figure is
  the pairs' count less the idle rate over their time: what serving a request costs, the per-second work apart
  (reported beside it: per second, not per request, so at any real rate a share of a request that tends to 0).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import yaml

from bench.meters.instructions import PACKAGES, Counted, count_cpu_task, per_unit, run_counted
from bench.meters.plane_meter import InstructionCounter
from bench.stack.local import answers_ok
from bench.stack.processes import RedisServer, api_argv, free_port, wait_until

CELL_NAMES = "abcdefghijklmnop"  # as contract.settings.cells allows: one hex digit of a job id
CLIENTS = 4  # HTTP clients, each a submit then its poll, in turn
_RESULT = {
    "detections": [{"box": [10.0, 20.0, 30.0, 40.0], "score": 0.9, "class_id": 0, "label": "circle"}] * 3,
    "image": {"width": 1920, "height": 1080},
    "model": {"name": "shapes-yolo", "version": "2.0.0"},
}


class ApiDriver:
    """The bench's side of a counted API: HTTP clients submitting and polling, and each job ended in its cell's
    Redis as the GPU worker's batch write ends it, before its poll is sent (the poll never waits: whether it did
    would depend on timing, and a wait adds a registration, a wake-up and a second read)."""

    def __init__(self, port: int, redis_urls: list[str], images: list[bytes]) -> None:
        from contract.redis.keys import Keys

        self.port, self.images = port, images
        self.clients: list[redis.Redis] = [redis.Redis.from_url(url, decode_responses=False) for url in redis_urls]
        self.keys = Keys("imgserve")
        self.stop_event = threading.Event()

    def wait_up(self, process: subprocess.Popen) -> None:
        def up() -> bool:
            if process.poll() is not None:  # gunicorn under valgrind gave up (a settings error, a failed import)
                raise RuntimeError(f"the API under valgrind exited with {process.returncode} before answering")
            return answers_ok(f"http://127.0.0.1:{self.port}/healthz", [])

        wait_until(up, 900, interval_s=1.0, what="the API under valgrind")

    def start(self) -> None:
        for client in self.clients:
            threading.Thread(target=self._finisher, args=(client,), daemon=True).start()

    def stop(self) -> None:
        self.stop_event.set()

    def _finisher(self, client: redis.Redis) -> None:
        from contract.jobs.ending import JobEnding
        from contract.jobs.record import SUCCEEDED

        store = JobEnding(client, self.keys, 3600)
        while not self.stop_event.is_set():
            queues = [
                key.decode() if isinstance(key, bytes) else key
                for key in client.keys(self.keys.celery_prefix + "preprocess*")
            ]
            if not queues:  # the first submit makes its model's queue
                time.sleep(0.05)
                continue
            taken = client.brpop(queues, timeout=0.2)
            if taken:
                job_id = json.loads(base64.b64decode(json.loads(taken[1])["body"]))[0][0]
                store.finish(job_id, SUCCEEDED, {"result": _RESULT, "timings": {}, "batched_at": time.time()})

    def _cell(self, job_id: str) -> redis.Redis:
        if len(self.clients) == 1:  # the measured checkout may predate cells (--base)
            return self.clients[0]
        from contract.jobs.ids import JobIds

        return self.clients[JobIds.cell_of(job_id)]

    def pairs(self, count: int) -> None:
        """`count` submits and their polls, over CLIENTS connections; a failure is raised (no count of a broken
        run)."""
        with ThreadPoolExecutor(CLIENTS) as pool:
            for done in [pool.submit(self._client_loop, count // CLIENTS, i) for i in range(CLIENTS)]:
                done.result()

    def _client_loop(self, turns: int, offset: int) -> None:
        import http.client

        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        for turn in range(turns):
            body = self.images[(offset + turn) % len(self.images)] + os.urandom(16)  # every image new to the cache
            connection.request("POST", "/v1/jobs", body=body, headers={"Content-Type": "image/jpeg"})
            reply = connection.getresponse()
            accepted = json.loads(reply.read())
            if reply.status != 202:
                raise RuntimeError(f"submit answered {reply.status}: {accepted}")
            job = accepted["id"]
            ended = functools.partial(_ended, self._cell(job), self.keys.job(job))
            wait_until(ended, 60, what="the bench to end the job")
            connection.request("GET", accepted["links"]["self"] + "?wait=30")
            document = json.loads(connection.getresponse().read())
            if document.get("status") != "succeeded":
                raise RuntimeError(f"a job did not succeed: {document}")


def _ended(client: redis.Redis, job_key: str) -> bool:
    return bool(client.hget(job_key, "status") == b"succeeded")


def _api_run(root: Path, cells: int, drive: Any) -> int:
    """The API (one gevent worker) under callgrind in front of `cells` cells, each its own redis-server (the
    first also the tier's, as `make run CELLS=N` runs them); `drive(process, out, driver)` does the work and
    stops it. The worker's whole count (the largest of the run's processes)."""
    work = Path(tempfile.mkdtemp(prefix="instructions-api-"))
    servers = []
    for index in range(cells):
        (work / f"cell-{index}").mkdir()
        servers.append(RedisServer(work / f"cell-{index}"))
    settings: dict[str, Any] = {"redis_url": servers[0].url, "api": {"workers": 1}}
    if cells > 1:
        settings["cells"] = [{"name": CELL_NAMES[i], "redis_url": s.url} for i, s in enumerate(servers)]
    (work / "config.yaml").write_text(yaml.safe_dump(settings))
    port = free_port()
    env = {**os.environ, "IMGSERVE_CONFIG": str(work / "config.yaml"), "IMGSERVE_API__BIND": f"127.0.0.1:{port}"}
    for name in ("PROMETHEUS_MULTIPROC_DIR", "IMGSERVE_CELLS", "IMGSERVE_REDIS_URL"):
        env.pop(name, None)

    def driving(process: subprocess.Popen, out: Path) -> None:
        driver = ApiDriver(port, [s.url for s in servers], images=drive.images)
        driver.wait_up(process)
        driver.start()
        try:
            drive(process, out, driver)
        finally:
            driver.stop()
            os.killpg(process.pid, signal.SIGTERM)

    try:
        return run_counted(api_argv("--timeout", "900"), root, env, work, driving)
    finally:
        for server in servers:
            server.stop()


class _Pairs:
    """count_api's drive: `count` pairs, the whole run counted."""

    def __init__(self, images: list[bytes], count: int) -> None:
        self.images, self.count = images, count

    def __call__(self, process: subprocess.Popen, out: Path, driver: ApiDriver) -> None:
        driver.pairs(self.count)


def count_api(root: Path, images: list[bytes], pairs: tuple[int, int] = (20, 100)) -> Counted:
    """Two runs' difference (the module's docstring), one cell."""
    first, second = (_api_run(root, 1, _Pairs(images, count)) for count in pairs)
    return Counted("api", "submit + poll", per_unit(first, second, *pairs))


class _Marked:
    """count_api_marked's drive: warm-up pairs, a mark, `idle_s` idle, a mark, `count` pairs timed, a mark."""

    def __init__(self, images: list[bytes], count: int, idle_s: float, warm: int) -> None:
        self.images, self.count, self.idle_s, self.warm = images, count, idle_s, warm
        self.idle = self.busy = 0
        self.busy_s = 0.0

    def __call__(self, process: subprocess.Popen, out: Path, driver: ApiDriver) -> None:
        counter = InstructionCounter(out, prefix="cg")
        counter.pid = wait_until(lambda: _worker(process.pid), 300, what="the gunicorn worker")
        # Lazy imports, the first reads of the choice's loads, and every cell's connection pools grown to the
        # clients' concurrency: with 8 pairs a second cell's pool still opened 6 connections in the counted pairs.
        driver.pairs(self.warm)
        counter.mark()
        idle_until = time.monotonic() + self.idle_s
        wait_until(lambda: time.monotonic() >= idle_until, self.idle_s + 60, interval_s=0.5, what="the idle period")
        self.idle = counter.mark()
        started = time.monotonic()
        driver.pairs(self.count)
        self.busy_s = time.monotonic() - started
        self.busy = counter.mark()
        print(f"    counted {self.count} pairs over {self.busy_s:.1f} s", file=sys.stderr)


def _worker(master: int) -> int:
    """The gunicorn master's one worker (0 while none is forked yet)."""
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return int(children[0]) if children else 0


def busy_less_idle(busy: int, busy_s: float, idle_per_s: float, units: int) -> float:
    """Instructions a unit: those counted over `units` less what the worker does a second idle, over their time."""
    if units <= 0:
        raise ValueError("no units counted")
    return (busy - idle_per_s * busy_s) / units


def count_api_marked(
    root: Path, images: list[bytes], pairs: int = 100, cells: int = 1, idle_s: float = 20.0, warm: int = 24
) -> Counted:
    """One run between marks (the module's docstring), in front of `cells` cells."""
    marked = _Marked(images, pairs, idle_s, warm)
    _api_run(root, cells, marked)
    idle_per_s = marked.idle / idle_s
    per_pair = busy_less_idle(marked.busy, marked.busy_s, idle_per_s, pairs)
    unit = "submit + poll" + (f", {cells} cells" if cells > 1 else "") + " (marked)"
    return Counted("api", unit, per_pair, idle_per_s=idle_per_s)


def count(
    role: str,
    root: Path,
    images: list[bytes],
    cells: int = 1,
    pairs: tuple[int, int] = (20, 100),
    marked: bool = False,
) -> Counted:
    """`role`'s instructions a unit on the checkout at `root` (`cells`, `pairs`, `marked`: the api role's,
    bench.meters.instructions_api: with cells, or `marked`, counted between marks in one run, its idle rate taken
    out)."""
    # Bytecode compiled first, outside the count: a module changed since its last import would be compiled in the
    # first, shorter run only, and the difference between the runs would come out short by that much.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *(str(root / name) for name in PACKAGES)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    if role == "api":
        if cells > 1 or marked:
            return count_api_marked(root, images, pairs[1], cells)
        return count_api(root, images, pairs)
    if role == "cpu-task":
        return count_cpu_task(root, images)
    raise ValueError(f"unknown role {role!r}: one of api, cpu-task")
