"""A GPU worker paused past its heartbeat (SIGSTOP, a stalled VM) has its frames given to another worker; when
it wakes it must not compute them again nor write them: it finds its epoch gone, gives back what it took
since, and exits for its supervisor (gpu_worker.heartbeat)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from bench.stack.processes import ManagedProcess, gpu_worker_argv, wait_until
from gpu_worker.worker import EXIT_PRESUMED_DEAD
from tests.conftest import Stack, content_box_spec, start_stack, stop_stack
from tests.support import jpeg

TTL_S = 3.0


@pytest.fixture(scope="module")
def fencing_stack(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("fencing")
    url = redis_server.url.rsplit("/", 1)[0] + "/9"
    stack = start_stack(
        url,
        workdir,
        content_box_spec(workdir, 64),
        "fencing",
        {"gpu_worker": {"heartbeat_ttl_s": TTL_S, "sim_latency_ms": {1: 150, 8: 300}}},
        gpu_device="sim",
    )
    yield stack
    stop_stack(stack)


def answered(process: ManagedProcess) -> list[str]:
    """The job ids of every batch the worker wrote."""
    ids = []
    for line in process.log_path.read_text().splitlines():
        if line.startswith("{") and (entry := json.loads(line)).get("msg") == "batch answered":
            ids += entry["job_ids"]
    return ids


def test_a_worker_paused_past_its_heartbeat_writes_nothing_it_held_and_stops(fencing_stack):
    stack = fencing_stack
    other = ManagedProcess(
        "gpu-worker-2",
        gpu_worker_argv("sim", "fencing-second"),
        stack.env,
        stack.log_dir,
    )
    paused = stack.gpu_worker
    assert paused is not None
    stop = threading.Event()
    submitted: list[str] = []

    def steady_load() -> None:
        while not stop.is_set():
            submitted.append(stack.submit_ok(jpeg(80, 60, seed=len(submitted))))
            stop.wait(0.05)

    try:
        wait_until(
            lambda: stack.redis.exists(stack.keys.heartbeat("fencing-second")), 60, what="the second GPU worker to beat"
        )
        load = threading.Thread(target=steady_load)
        load.start()
        wait_until(
            lambda: stack.redis.llen(stack.keys.processing(stack.gpu_worker_id, stack.settings.models[0].key)),
            30,
            interval_s=0.005,
            what="the first worker to hold frames",
        )
        os.kill(paused.process.pid, signal.SIGSTOP)  # frames in hand, past its heartbeat
        wait_until(
            lambda: "requeued" in other.log_tail() and "of dead GPU worker" in other.log_tail(),
            30,
            what="the second worker to take the paused one's frames",
        )
        os.kill(paused.process.pid, signal.SIGCONT)
        status = paused.process.wait(30)
        after = len(submitted)  # the load goes on a while with the second worker alone
        wait_until(lambda: len(submitted) >= after + 10, 30, what="ten more jobs after the paused worker stopped")
        stop.set()
        load.join()
        docs = [stack.wait_terminal(job_id, timeout_s=60) for job_id in submitted]
    finally:
        stop.set()
        if paused.alive():
            os.kill(paused.process.pid, signal.SIGCONT)
        other.stop()
        stack.gpu_worker = None
        stack.start_gpu_worker()
    assert status == EXIT_PRESUMED_DEAD and "presumed dead" in paused.log_tail()
    assert [doc["status"] for doc in docs] == ["succeeded"] * len(docs)
    twice = [job for job, count in Counter(answered(paused) + answered(other)).items() if count > 1]
    assert twice == []  # no job answered by both
    assert {doc["batch"]["worker"] for doc in docs} >= {"fencing-second"}
