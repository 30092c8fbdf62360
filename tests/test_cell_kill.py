"""A cell's Redis killed under load (docs/cells.md): two cells, each a private redis-server with its own CPU
worker and GPU worker (sim), one API over both; one cell's Redis SIGKILLed while a client submits steadily. Every
client operation is recorded and the history checked after (bench/faults/history.py): new submissions go to the living
cell at once (the first 202 after the kill within 1 s, no 5xx to a new submission), every job it accepted
succeeds, and the dead cell's jobs answer 503 while it is down."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from app import create_app
from bench.faults.history import History, check, kept
from contract.jobs.ids import JobIds
from contract.jobs.record import TERMINAL
from contract.settings.cells import CellSettings
from tests.conftest import STACK_INPUT_SIZE, Stack, content_box_spec, start_stack, stop_stack
from tests.support import ApiServer, RedisServer, jpeg

SUBMIT_EVERY_S = 0.12  # about 8 a second: well within what either cell alone carries
DEADLINE_MS = 30_000


@pytest.fixture
def two_cell_stacks(tmp_path: Path) -> Iterator[tuple[ApiServer, list[Stack], list[RedisServer]]]:
    servers, stacks = [], []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        servers.append(RedisServer(folder))
        model = content_box_spec(folder, STACK_INPUT_SIZE, weights="test fixture", conf=0.25, iou=0.45, max_det=10)
        stacks.append(start_stack(servers[-1].url, folder, model, "cellkill", gpu_device="sim"))
    settings = stacks[0].settings
    settings = dataclasses.replace(
        settings,
        redis_url=servers[0].url,  # the tier's Redis: the first cell's, as make run CELLS=N runs it
        bulk=dataclasses.replace(settings.bulk, retry_s=1.0),
        cells=(CellSettings(name="a", redis_url=servers[0].url), CellSettings(name="b", redis_url=servers[1].url)),
    )
    api = ApiServer(create_app(settings))
    yield api, stacks, servers
    api.stop()
    if servers[1].process.poll() is not None:
        servers[1].start()  # back (empty), so its workers stop as they always do
    for stack in stacks:
        stop_stack(stack)
    for server in servers:
        server.stop()


def _submit(session: requests.Session, url: str, history: History) -> None:
    started = time.monotonic()
    try:
        answer = session.post(
            url + f"/v1/jobs?deadline_ms={DEADLINE_MS}",
            data=jpeg(96, 64, seed=int(started * 1000) % 997),
            headers={"Content-Type": "image/jpeg"},
            timeout=30,
        )
    except requests.RequestException as exc:
        history.submit(started, type(exc).__name__)
        return
    job = answer.json().get("id") if answer.status_code == 202 else None
    history.submit(started, answer.status_code, job, answer.json().get("type", "").rsplit("/", 1)[-1])


def _read(session: requests.Session, url: str, history: History, job: str, wait: float = 0) -> tuple[int, str]:
    """The read's HTTP status and the job's status as read ("" when it was refused)."""
    started = time.monotonic()
    answer = session.get(f"{url}/v1/jobs/{job}", params={"wait": wait} if wait else None, timeout=wait + 30)
    doc = answer.json() if answer.status_code == 200 else None
    problem = "" if doc else answer.json().get("type", "").rsplit("/", 1)[-1]
    history.read(job, started, answer.status_code, doc, problem)
    return answer.status_code, doc["status"] if doc else ""


def test_a_cells_redis_killed_under_load_costs_no_new_submission_and_no_job_of_the_living_cell(two_cell_stacks):
    api, stacks, servers = two_cell_stacks
    history, stop = History(), threading.Event()
    session = requests.Session()

    def load() -> None:
        while not stop.is_set():
            _submit(session, api.url, history)
            stop.wait(SUBMIT_EVERY_S)

    client = threading.Thread(target=load, daemon=True)
    client.start()
    time.sleep(3.0)  # the load's steady part before the fault, not a synchronisation
    killed_at = time.monotonic()
    servers[1].process.send_signal(signal.SIGKILL)
    servers[1].process.wait(10)
    history.fault = (killed_at, killed_at)
    time.sleep(4.0)  # load on the living cell alone
    stop.set()
    client.join(30)

    accepted = history.accepted()
    in_cell = {job: JobIds.cell_of(job) for job in accepted}
    assert set(in_cell.values()) == {0, 1}, "both cells took jobs before the kill"
    after = [op for op in history.ops if op.kind == "submit" and op.started >= killed_at]
    assert after and all(op.code == 202 for op in after), [(op.code, op.problem) for op in after if op.code != 202]
    assert all(in_cell[op.job] == 0 for op in after if op.job)  # every new job in the living cell
    verdict = check(history, DEADLINE_MS)
    assert verdict["first_202_after_heal_s"] is not None and verdict["first_202_after_heal_s"] <= 1.0, verdict

    # Every job of the living cell read to its end; the dead cell's answer 503 while it is down.
    living = [job for job, cell in in_cell.items() if cell == 0]
    for job in living:
        deadline = time.monotonic() + 60
        while _read(session, api.url, history, job, wait=5)[1] not in TERMINAL:
            assert time.monotonic() < deadline, f"job {job} did not end"
    for job in [job for job, cell in in_cell.items() if cell == 1]:
        assert _read(session, api.url, history, job)[0] == 503
    only_living = History(ops=[op for op in history.ops if op.job is None or in_cell.get(op.job) == 0])
    verdict = check(only_living, DEADLINE_MS)
    assert kept(verdict) and verdict["lost"] == 0 and verdict["ends"] == {"succeeded": len(living)}, verdict
    print(
        f"cell-kill: {len(accepted)} accepted, {len(living)} in the living cell, first 202 after the kill "
        f"{check(history, DEADLINE_MS)['first_202_after_heal_s']} s, {len(after)} submissions after it, all 202"
    )
