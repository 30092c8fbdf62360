"""`make run CELLS=2` as a reader runs it, from a copy of the checkout: two cells, each a private Redis with its own
CPU, callback and GPU workers and Flower, behind one API; what it prints names each cell's Redis and Flower; a
JPEG goes through; SIGINT (what make relays on Ctrl-C) stops every process, both Redis servers included."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests

from bench.stack.processes import REPO_ROOT, ManagedProcess, children_of, free_port, wait_until
from contract.redis.keys import Keys
from tests.support import jpeg
from tests.test_make_run import listening_addresses
from tools.newcomer_check import copy_checkout, newcomer_env

pytestmark = pytest.mark.integration
FLOWER_PASSWORD = "cells-test-0123456789abcdef"
JPEG = {"Content-Type": "image/jpeg"}

CELL_LINE = re.compile(
    r"^  cell ([a-z]): Redis redis://127\.0\.0\.1:(\d+)/0 \(data in var/redis-cell-\1\), "
    r"Flower at http://127\.0\.0\.1:(\d+), GPU worker metrics at http://127\.0\.0\.1:(\d+)/metrics$",
    re.MULTILINE,
)


@dataclass
class CellsRun:
    root: Path
    process: ManagedProcess
    api_url: str
    env: dict[str, str]
    flower_auth: tuple[str, str]

    def log(self) -> str:
        return self.process.log_tail(400_000)

    def cells(self) -> dict[str, tuple[int, int, int]]:
        """Each cell's Redis, Flower and GPU-metrics ports, as the ready line prints them."""
        return {name: (int(r), int(f), int(m)) for name, r, f, m in CELL_LINE.findall(self.log())}


def free_port_pair() -> int:
    """A port free on 127.0.0.1 with the next one free too: the second cell binds FLOWER_PORT+1 and
    GPU_METRICS_PORT+1."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def cells_env(root: Path) -> dict[str, str]:
    api_port = free_port()
    return {
        **newcomer_env(root, api_port, free_port_pair(), free_port_pair()),
        "CELLS": "2",
        "IMGSERVE_GPU_WORKER__DEVICE": "sim",
        "CPU_WORKERS": "1",
        "FLOWER_BASIC_AUTH": f"flower:{FLOWER_PASSWORD}",
    }


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("make-run-cells") / "imgserve"
    root.mkdir()
    copy_checkout(REPO_ROOT, root, fresh_venv=False)
    return root


@contextmanager
def running_cells(name: str, root: Path, env: dict[str, str]) -> Iterator[CellsRun]:
    """make run (scripts/run-local) of the checkout at `root` with `env`, from its ready line until the block ends."""
    # Started as a shell's background job is (`make run &` in a script, a CI step run with &): SIGINT ignored from
    # the start, which bash cannot trap; run-local starts itself again with SIGINT at its default, and the SIGINT
    # test below holds that.
    run_local = str(root / "scripts" / "run-local")
    process = ManagedProcess(name, ["bash", "-c", 'trap "" INT; exec "$0"', run_local], env, root.parent, root=root)
    run = CellsRun(root, process, f"http://{env['IMGSERVE_API__BIND']}", env, ("flower", FLOWER_PASSWORD))
    try:
        wait_until(lambda: "make run: ready at" in run.log() or not process.alive(), 240, what="make run's ready line")
        assert process.alive(), run.log()[-5000:]
        yield run
    finally:
        process.stop(timeout_s=60)


@pytest.fixture(scope="module")
def cells_run(checkout: Path) -> Iterator[CellsRun]:
    with running_cells("make-run-cells", checkout, cells_env(checkout)) as run:
        yield run


def test_the_ready_line_names_each_cells_redis_and_flower(cells_run):
    cells = cells_run.cells()
    assert sorted(cells) == ["a", "b"], cells_run.log()[-3000:]
    flower_port = int(cells_run.env["FLOWER_PORT"])
    metrics_port = int(cells_run.env["GPU_METRICS_PORT"])
    assert [cells["a"][1], cells["b"][1]] == [flower_port, flower_port + 1]
    assert [cells["a"][2], cells["b"][2]] == [metrics_port, metrics_port + 1]
    assert cells["a"][0] != cells["b"][0]
    assert f"make run: ready at {cells_run.api_url}: the API of 2 cells" in cells_run.log()


def test_each_cell_has_its_own_redis_flower_and_gpu_worker(cells_run):
    keys = Keys("imgserve")
    for name, (redis_port, flower_port, metrics_port) in cells_run.cells().items():
        assert listening_addresses(redis_port) == {"127.0.0.1"}, name
        assert (cells_run.root / f"var/redis-cell-{name}/redis.log").is_file()
        client = redis.Redis(port=redis_port)
        # The cell's GPU worker heartbeats in its cell's Redis: it serves that cell.
        workers = wait_until(lambda: client.zrange(keys.gpu_workers, 0, -1), 60, what=f"cell {name}'s GPU worker")
        assert all(client.exists(keys.heartbeat(worker.decode())) for worker in workers), name
        # The cell's CPU and callback workers' processes heartbeat in its cell's Redis too.
        assert wait_until(
            lambda: len(list(client.scan_iter(keys.cpu_heartbeat("*")))) >= 2, 60, what=f"cell {name}'s Celery"
        )
        flower = wait_until(
            lambda: _get(f"http://127.0.0.1:{flower_port}/workers", cells_run.flower_auth), 60, what="Flower"
        )
        assert flower.status_code == 200, name
        assert requests.get(f"http://127.0.0.1:{flower_port}/", timeout=5).status_code == 401, name
        metrics = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        assert metrics.status_code == 200 and "imgserve" in metrics.text, name


def _get(url: str, auth: tuple[str, str]) -> requests.Response | None:
    try:
        return requests.get(url, auth=auth, timeout=5)
    except requests.RequestException:
        return None


def test_a_jpeg_goes_through_the_api_to_succeeded(cells_run):
    response = requests.post(
        f"{cells_run.api_url}/v1/jobs?wait=30",
        files={"image": (REPO_ROOT / "samples" / "shapes-3.jpg").read_bytes()},
        timeout=40,
    )
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded"
    assert isinstance(response.json()["result"]["detections"], list)  # the sim device's: boxes, not the truth


def test_the_api_reports_both_cells_and_sends_jobs_to_each(cells_run):
    """The API reads the `cells` setting from IMGSERVE_CELLS: /v1/stats names each cell
    at the Redis make run printed, and new jobs go to both (the less loaded of two: twelve jobs never all to one)."""
    stats = requests.get(f"{cells_run.api_url}/v1/stats", timeout=10).json()
    assert "cells" in stats, "the API did not read IMGSERVE_CELLS"
    printed = cells_run.cells()
    reported = {cell["name"]: cell for cell in stats["cells"]["cells"]}
    assert sorted(reported) == ["a", "b"]
    for name, (redis_port, _flower, _metrics) in printed.items():
        assert reported[name]["redis"] == f"redis://127.0.0.1:{redis_port}/0" and reported[name]["status"] == "up"
    ids = []
    for seed in range(12):
        response = requests.post(
            f"{cells_run.api_url}/v1/jobs?wait=30", data=jpeg(64, 48, seed=seed), headers=JPEG, timeout=40
        )
        assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
        ids.append(response.json()["id"])
    keys = Keys("imgserve")
    held = {
        name: sum(redis.Redis(port=redis_port).exists(keys.job(job_id)) for job_id in ids)
        for name, (redis_port, _flower, _metrics) in printed.items()
    }
    assert sum(held.values()) == len(ids) and min(held.values()) >= 1, held


def test_a_killed_cells_redis_is_started_again_while_the_other_cell_serves(cells_run):
    """Cell b's Redis SIGKILLed: make run starts it again on its port and data, its workers find it again, and
    meanwhile a new submission is served (by cell a: the API tier marks a cell that does not answer down)."""
    port = cells_run.cells()["b"][0]
    client = redis.Redis(port=port)
    client.set("make-run-cells:marker", "kept")
    client.execute_command("BGREWRITEAOF")  # the marker in the append-only file, whatever its fsync's timing
    wait_until(lambda: client.info("persistence")["aof_rewrite_in_progress"] == 0, 30, what="the rewrite")
    killed = int(client.info("server")["process_id"])
    os.kill(killed, signal.SIGKILL)
    response = requests.post(
        f"{cells_run.api_url}/v1/jobs?wait=30", data=jpeg(64, 48, seed=99), headers=JPEG, timeout=40
    )
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
    wait_until(lambda: "redis-server started again" in cells_run.log(), 60, what="make run to start cell b's Redis")
    assert f"the redis-server it started (pid {killed}) ended (status 137)" in cells_run.log()
    assert "var/redis-cell-b" in cells_run.log().split(f"(pid {killed}) ended")[1].splitlines()[0]
    assert client.get("make-run-cells:marker") == b"kept" and int(client.info("server")["process_id"]) != killed
    keys = Keys("imgserve")
    client.delete(keys.gpu_workers)  # written again only by a GPU worker that found its Redis again
    assert wait_until(lambda: client.zrange(keys.gpu_workers, 0, -1), 60, what="cell b's GPU worker back")


def _descendants(pid: int) -> set[int]:
    found, frontier = set(), {pid}
    while frontier:
        frontier = set().union(*(children_of(p) for p in frontier)) - found
        found |= frontier
    return found


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _signal_state(pid: int) -> str:
    """What a process does with signals, and where it waits: enough to tell a signal ignored from one not acted on."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return "gone"
    fields = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return ", ".join(line for line in status if line.split(":")[0] in fields) + f", wchan {wchan}"


def _live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigint_stops_every_process_of_every_cell(cells_run):
    """Last in this file: it ends the run."""
    cells = cells_run.cells()
    redis_pids = {int(redis.Redis(port=ports[0]).info("server")["process_id"]) for ports in cells.values()}
    every = _descendants(cells_run.process.process.pid)
    assert redis_pids <= every
    assert len(every) >= 12, every  # two Redis, the supervisor, one API and four processes a cell
    os.kill(cells_run.process.process.pid, signal.SIGINT)
    try:
        status = cells_run.process.process.wait(60)
    except subprocess.TimeoutExpired:
        # what still runs, and what the run said: a stop that hangs must say where
        still = {pid: _command_line(pid) for pid in every if _live(pid)}
        supervisors = [pid for pid, command in still.items() if "tools.procfile" in command]
        shells = {pid: _signal_state(pid) for pid in [cells_run.process.process.pid, *supervisors]}
        pytest.fail(
            f"make run still running 60 s after SIGINT; run-local's and the supervisor's signal state: {shells}; "
            f"still running: {still}\n{cells_run.log()[-4000:]}"
        )
    assert status == 0, cells_run.log()[-3000:]
    assert not [pid for pid in every if _live(pid)]
    assert cells_run.log().count("stopped the redis-server it started") == 2
    for redis_port, flower_port, metrics_port in cells.values():
        assert (
            not listening_addresses(redis_port) | listening_addresses(flower_port) | listening_addresses(metrics_port)
        )


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"REDIS": "sentinel", "REDIS_PORT": "6390"}, "REDIS_PORT with REDIS=sentinel"),
        ({"REDIS": "shared"}, "REDIS=shared: not a choice"),
        ({"IMGSERVE_BULK__REDIS_URLS": "[redis://127.0.0.1:1/0]"}, "the settings name bulk shards"),
        ({"IMGSERVE_CELLS": "[{name: a, redis_url: 'redis://127.0.0.1:1/0'}]"}, "IMGSERVE_CELLS is set"),
        ({"CELLS": "9"}, "make run runs 1 to 8 cells on one machine"),
        ({"CELLS": "two"}, "CELLS=two: not a number of cells"),
    ],
)
def test_what_cells_cannot_share_is_refused_before_anything_starts(checkout: Path, extra: dict, said: str):
    env = {**cells_env(checkout), **extra}
    done = subprocess.run(
        [str(checkout / "scripts" / "run-local")], env=env, cwd=checkout, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert said in done.stderr
    assert "procfile:" not in done.stderr and "cell a: Redis" not in done.stderr
