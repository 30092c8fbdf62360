"""Celery's own autoscaler on the product's backlog (tasks.hop.autoscale, issue 61): a real CPU worker started as
`CPU_AUTOSCALE=1,3` starts it (`--autoscale=3,1`), a burst over two models grows its pool to 3 children, and once
idle it shrinks back to 1 without killing or redelivering a task, while the GPU worker's recent rate still counts
both models' jobs. Celery's shrink delay (AUTOSCALE_KEEPALIVE, 30 s) is 4 s here."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.stack.processes import children_of, wait_until
from tests.conftest import Stack, content_box_spec, start_stack, stop_stack
from tests.support import encode, make_image

KEEPALIVE_S = 4
MODELS = ("content-box", "content-box-b")


@pytest.fixture(scope="module")
def autoscaled(redis_server, tmp_path_factory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("autoscale")
    url = redis_server.url.rsplit("/", 1)[0] + "/12"
    spec = content_box_spec(workdir, 640)
    stack = start_stack(
        url,
        workdir,
        None,
        "autoscale",
        # 60 jobs at 40 ms each before any is answered, to be drained in 0.5 s: far more than 3 processes
        {"models": [spec, {**spec, "name": MODELS[1]}], "scaling": {"default_cpu_ms": 40.0, "drain_s": 0.5}},
        cpu_worker_args=("--autoscale=3,1",),
        env_extra={"AUTOSCALE_KEEPALIVE": str(KEEPALIVE_S)},
    )
    yield stack
    stop_stack(stack)


def heavy(seed: int) -> bytes:
    """A 1920x1080 PNG: ~20 ms of decoding here (a JPEG is decoded at a fraction of its size for a small model)."""
    return encode(make_image(1920, 1080, seed=seed), "PNG")


def children(stack: Stack) -> int:
    """The CPU worker's pool processes (the main process's children)."""
    return len(children_of(stack.cpu_worker.process.pid))


def test_a_burst_grows_the_pool_to_its_maximum_and_idleness_shrinks_it_back_with_no_task_lost_or_redone(autoscaled):
    stack = autoscaled
    wait_until(lambda: children(stack) == 1, 30, what="the pool at its minimum, 1")
    images = [heavy(i) for i in range(60)]
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        replies = list(
            pool.map(lambda i: stack.submit(images[i], "image/png", model=MODELS[i % 2]), range(len(images)))
        )
    assert [reply.status_code for reply in replies] == [202] * 60
    ids = [reply.json()["id"] for reply in replies]
    grown_at = wait_until(lambda: children(stack) == 3 and time.monotonic(), 10, what="the pool grown to 3")
    print(f"the pool reached 3 children {grown_at - started:.1f} s after the burst began")
    docs = [stack.wait_terminal(job_id) for job_id in ids]
    assert [doc["status"] for doc in docs] == ["succeeded"] * 60
    assert {doc["model"]["name"] for doc in docs} == set(MODELS)
    idle_at = time.monotonic()
    wait_until(lambda: children(stack) == 1, KEEPALIVE_S * 2 + 20, what="the pool back at 1")
    print(f"back at 1 child {time.monotonic() - idle_at:.1f} s after the last job ended")
    # a shrink retires idle children only: no task was given back or sent again
    assert all(not stack.redis.hget(stack.keys.job(job_id), "resent") for job_id in ids)
    log = stack.cpu_worker.log_tail(200_000)
    assert "WorkerLostError" not in log and "Restoring" not in log
    assert "Scaling down" in log and "Scaling up" in log
