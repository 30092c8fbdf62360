"""`bench instructions`: the CPU work of one unit counted in instructions by valgrind's callgrind, the same
figure run after run whatever else this shared machine does.

    python -m bench instructions --role api,cpu-task
    python -m bench instructions --role api --base HEAD~1      # two builds, side by side
    python -m bench instructions --role api --cells 2          # the API in front of one cell, then two

CPU seconds per image move by a third from one minute to the next here, more than most single changes to the
stack's overhead; an instruction count does not move. It counts user-space instructions only: not the kernel's
work (a socket's send and receive), not cache misses, not Redis. So it decides between two versions of Python
code; `bench ab` remains the figure users see.

- api: one gevent API worker under gunicorn (the project's gunicorn config, one worker), per submit of a
  0.4-1 MB JPEG (raw body) and a poll of its job, each job ended by the bench as the GPU worker's batch write
  would end it (JobEnding.finish) before the poll is sent: the poll never waits. Whether a poll waited depends
  on timing, and the count would move with it; a wait adds a registration, a wake-up and a second read of
  the job, which this figure leaves out. Counted: gunicorn, gevent, Flask, the app, redis-py, in that worker
  (its pub/sub listener hears every job's end either way).
  With `--cells N` the same API worker counted twice in one run, in front of one cell and then of N cells
  (docs/cells.md: the chooser places every job, each cell its own Redis), so the API tier's cost of cells shows.
- cpu-task: one CPU worker child's task (Preprocessor.run: claim, read the upload, decode, letterbox, pack,
  push), and decode + letterbox alone on the same images: the difference is the task's plumbing. Celery's
  own work per task (its main process's receive, hand-off and ack) is not in it.

Each figure is the difference between a run of N1 units and one of N2, over N2 - N1: start-up and imports
cancel out. A run of the API takes minutes (valgrind runs Python some 50 times slower).
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import redis
import yaml

from bench.processes import RedisServer, api_argv, free_port, wait_until
from bench.stack import answers_ok

ROLES = ("api", "cpu-task")
CELL_NAMES = "abcdefghijklmnop"  # as contract.cells allows: one hex digit of a job id
PACKAGES = ("app", "contract", "tasks", "gpu_worker")  # the measured checkout's code
CHILD = Path(__file__).with_name("instructions_child.py")  # run by path: it imports the measured checkout's code
_RESULT = {
    "detections": [{"box": [10.0, 20.0, 30.0, 40.0], "score": 0.9, "class_id": 0, "label": "circle"}] * 3,
    "image": {"width": 1920, "height": 1080},
    "model": {"name": "shapes-yolo", "version": "2.0.0"},
}


@dataclass(frozen=True)
class Counted:
    role: str
    unit: str
    per_unit: float  # instructions
    reference: float | None = None  # cpu-task: decode + letterbox alone, per image

    @property
    def over_reference(self) -> float | None:
        return self.per_unit - self.reference if self.reference is not None else None


def callgrind_total(text: str) -> int:
    """The instructions a callgrind output file counts (its `totals:` or `summary:` line)."""
    for line in text.splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError("no totals in this callgrind output")


def per_unit(first: int, second: int, first_units: int, second_units: int) -> float:
    """Instructions per unit from two runs of different lengths (what both runs share cancels out)."""
    if second_units <= first_units:
        raise ValueError("the second run must hold more units than the first")
    return (second - first) / (second_units - first_units)


def _counted(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    work: Path,
    drive: Callable[[subprocess.Popen], None] = lambda process: None,
) -> int:
    """Run `argv` (and its children) under callgrind; `drive` does the work meanwhile and stops it. The largest
    count of its processes: the one that did the work (a gunicorn worker, not its master)."""
    out = Path(tempfile.mkdtemp(prefix="callgrind-", dir=work))
    process = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--trace-children=yes", f"--callgrind-out-file={out}/cg.%p", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(out / "stderr", "w"),
        start_new_session=True,
    )
    try:
        drive(process)
        process.wait(timeout=1800)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    counts = [callgrind_total(path.read_text()) for path in out.glob("cg.*")]
    if process.returncode or not counts:
        raise RuntimeError(f"{argv[0]} under valgrind failed: {(out / 'stderr').read_text()[-2000:]}")
    return max(counts)


def count_api(root: Path, images: list[bytes], pairs: tuple[int, int] = (20, 100), cells: int = 1) -> Counted:
    """The API worker's instructions a submit and its poll. `cells` over 1: the same API in front of that many
    cells (docs/cells.md: each its own redis-server, the first also the tier's, as `make run CELLS=N` runs them),
    every submission placed by the chooser."""

    def run(count: int) -> int:
        work = Path(tempfile.mkdtemp(prefix="instructions-api-"))
        servers = []
        for index in range(cells):
            (work / f"cell-{index}").mkdir()
            servers.append(RedisServer(work / f"cell-{index}"))
        config = work / "config.yaml"
        settings: dict = {"redis_url": servers[0].url, "api": {"workers": 1}}
        if cells > 1:
            settings["cells"] = [{"name": CELL_NAMES[i], "redis_url": s.url} for i, s in enumerate(servers)]
        config.write_text(yaml.safe_dump(settings))
        port = free_port()
        env = {**os.environ, "IMGSERVE_CONFIG": str(config), "IMGSERVE_API__BIND": f"127.0.0.1:{port}"}
        for name in ("PROMETHEUS_MULTIPROC_DIR", "IMGSERVE_CELLS", "IMGSERVE_REDIS_URL"):
            env.pop(name, None)
        try:
            return _counted(
                api_argv("--timeout", "900"),
                root,
                env,
                work,
                lambda process: _drive_api(process, port, [s.url for s in servers], images, count),
            )
        finally:
            for server in servers:
                server.stop()

    unit = "submit + poll" if cells == 1 else f"submit + poll, {cells} cells"
    return Counted("api", unit, per_unit(run(pairs[0]), run(pairs[1]), *pairs))


def _drive_api(process: subprocess.Popen, port: int, redis_urls: list[str], images: list[bytes], count: int) -> None:
    import http.client

    from contract.jobs.ending import JobEnding
    from contract.jobs.record import SUCCEEDED
    from contract.keys import Keys

    def up() -> bool:
        if process.poll() is not None:  # gunicorn under valgrind gave up (a settings error, a failed import)
            raise RuntimeError(f"the API under valgrind exited with {process.returncode} before answering")
        return answers_ok(f"http://127.0.0.1:{port}/healthz", [])

    wait_until(up, 900, interval_s=1.0, what="the API under valgrind")
    clients: list[redis.Redis] = [redis.Redis.from_url(url, decode_responses=False) for url in redis_urls]
    keys = Keys("imgserve")
    stop = threading.Event()

    def finisher(client: redis.Redis) -> None:  # each job ended as the GPU worker's batch write ends it
        store = JobEnding(client, keys, 3600)
        while not stop.is_set():
            queues = [
                key.decode() if isinstance(key, bytes) else key
                for key in client.keys(keys.celery_prefix + "preprocess*")
            ]
            if not queues:  # the first submit makes its model's queue
                time.sleep(0.05)
                continue
            taken = client.brpop(queues, timeout=0.2)
            if taken:
                job_id = json.loads(base64.b64decode(json.loads(taken[1])["body"]))[0][0]
                store.finish(job_id, SUCCEEDED, {"result": _RESULT, "timings": {}, "batched_at": time.time()})

    def cell_of(job_id: str) -> redis.Redis:
        if len(clients) == 1:  # the measured checkout may predate cells (--base)
            return clients[0]
        from contract.jobs.ids import JobIds

        return clients[JobIds.cell_of(job_id)]

    def client_loop(turns: int, offset: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        for turn in range(turns):
            body = images[(offset + turn) % len(images)] + os.urandom(16)  # every image new to the cache
            connection.request("POST", "/v1/jobs", body=body, headers={"Content-Type": "image/jpeg"})
            reply = connection.getresponse()
            accepted = json.loads(reply.read())
            if reply.status != 202:
                raise RuntimeError(f"submit answered {reply.status}: {accepted}")
            job = accepted["id"]
            wait_until(functools.partial(_ended, cell_of(job), keys.job(job)), 60, what="the bench to end the job")
            connection.request("GET", accepted["links"]["self"] + "?wait=30")
            document = json.loads(connection.getresponse().read())
            if document.get("status") != SUCCEEDED:
                raise RuntimeError(f"a job did not succeed: {document}")

    for client in clients:
        threading.Thread(target=finisher, args=(client,), daemon=True).start()
    try:
        with ThreadPoolExecutor(4) as pool:  # a client's failure is raised here: no count of a broken run
            for done in [pool.submit(client_loop, count // 4, i) for i in range(4)]:
                done.result()
    finally:
        stop.set()
        os.killpg(process.pid, signal.SIGTERM)


def _ended(client: redis.Redis, job_key: str) -> bool:
    return bool(client.hget(job_key, "status") == b"succeeded")


def count_cpu_task(root: Path, images: list[bytes], tasks: tuple[int, int] = (10, 60)) -> Counted:
    work = Path(tempfile.mkdtemp(prefix="instructions-task-"))
    for index, image in enumerate(images[:4]):
        (work / f"image-{index}.jpg").write_bytes(image)

    def run(mode: str, count: int) -> int:
        server = RedisServer(work)
        try:
            if mode == "task":
                _store_jobs(root, server.url, work, count)
            argv = [sys.executable, str(CHILD), str(root), server.url, str(work), mode, str(count)]
            return _counted(argv, root, dict(os.environ), work)
        finally:
            server.stop()

    task = per_unit(run("task", tasks[0]), run("task", tasks[1]), *tasks)
    decode = per_unit(run("decode", tasks[0]), run("decode", tasks[1]), *tasks)
    return Counted("cpu-task", "task", task, reference=decode)


def _store_jobs(root: Path, redis_url: str, work: Path, count: int) -> None:
    """The jobs the child's tasks take, stored as the API stores them, outside the count."""
    subprocess.run(
        [sys.executable, str(CHILD), str(root), redis_url, str(work), "store", str(count)], cwd=root, check=True
    )


def count(role: str, root: Path, images: list[bytes], cells: int = 1, pairs: tuple[int, int] = (20, 100)) -> Counted:
    """`role`'s instructions a unit on the checkout at `root` (`cells`, `pairs`: the api role's, count_api's)."""
    # Bytecode compiled first, outside the count: a module changed since its last import would be compiled in the
    # first, shorter run only, and the difference between the runs would come out short by that much.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *(str(root / name) for name in PACKAGES)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    if role == "api":
        return count_api(root, images, pairs, cells)
    if role == "cpu-task":
        return count_cpu_task(root, images)
    raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")


def markdown(counted: dict[str, list[Counted]]) -> str:
    """One table: a row per role and side."""
    lines = [
        "## bench instructions: user-space instructions per unit (valgrind callgrind)",
        "",
        "| side | role | unit | instructions | decode + letterbox alone | over it |",
        "|---|---|---|---|---|---|",
    ]
    for side, rows in counted.items():
        for row in rows:
            reference = f"{row.reference / 1e6:.2f} M" if row.reference is not None else "-"
            over = f"{row.over_reference / 1e6:.2f} M" if row.over_reference is not None else "-"
            lines.append(f"| {side} | {row.role} | {row.unit} | {row.per_unit / 1e6:.2f} M | {reference} | {over} |")
    return "\n".join(lines)
