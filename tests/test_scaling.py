"""The backlog as the product sees it and the CPU worker processes it wants (contract.workers.scaling, issue 61): the
arithmetic alone, the held messages read from the workers' holds, and on a real stack during a burst, checked
every quarter second against a count the test keeps itself (each accepted job's own status)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from contract.redis.keys import Keys
from contract.settings.scaling import ScalingSettings
from contract.workers.scaling import (
    ModelBacklog,
    held_by_model,
    model_of_queue,
    pool_wanted,
    scaling_signal,
    wanted_workers,
    windows_of,
)
from tests.conftest import Stack, content_box_spec, start_stack, stop_stack
from tests.support import jpeg

SETTINGS = ScalingSettings(target_utilisation=0.7, drain_s=1.0, default_cpu_ms=25.0)


def test_the_wanted_processes_keep_up_with_the_rate_and_drain_what_waits_within_drain_s():
    idle = ModelBacklog(queued=0, held=0, frames=0)
    assert wanted_workers(idle, 0.0, 20.0, SETTINGS) == 0
    # 60 jobs of 25 ms each, nothing answered yet: 1.5 CPU-seconds to decode within 1 s at 70%: 3 processes
    burst = ModelBacklog(queued=55, held=5, frames=0)
    assert wanted_workers(burst, 0.0, 25.0, SETTINGS) == 3
    # a steady 56 jobs a second of 25 ms: 1.4 processes busy, 2 at 70%; frames need no CPU worker
    steady = ModelBacklog(queued=0, held=2, frames=40)
    assert wanted_workers(steady, 56.0, 25.0, SETTINGS) == 3  # 56 x 0.025 + 2 x 0.025 = 1.45 -> /0.7 = 2.07
    assert wanted_workers(ModelBacklog(0, 0, 40), 56.0, 25.0, SETTINGS) == 2


def test_an_idle_model_wants_no_process_while_its_recent_rate_decays():
    # the burst is over: nothing queued, held or waiting, but the GPU workers' windows still count its jobs
    idle = ModelBacklog(queued=0, held=0, frames=0)
    assert wanted_workers(idle, 2.5, 25.0, SETTINGS) == 0
    assert scaling_signal(idle, [{"jobs": 150, "window_s": 60.0}], SETTINGS).cpu_workers_wanted == 0


def test_two_idle_models_want_the_pools_minimum_and_busy_ones_add_up_their_real_work():
    windows = [{"jobs": 150, "window_s": 300.0, "time_bill_ms": {"decode": {"mean": 20.0}, "resize": {"mean": 1.0}}}]
    idle = [scaling_signal(ModelBacklog(0, 0, 0), windows, SETTINGS) for _ in range(2)]
    assert pool_wanted(idle, nodes=1, minimum=1, maximum=3) == 1
    # each model has one image decoding: 21 ms of 0.5/s + 21 ms within 1 s is 0.04 processes each; one
    # process carries both (rounding each model up first would ask for two)
    light = [scaling_signal(ModelBacklog(0, 1, 0), windows, SETTINGS) for _ in range(2)]
    assert [signal.cpu_workers_wanted for signal in light] == [1, 1]
    assert pool_wanted(light, nodes=1, minimum=0, maximum=3) == 1
    burst = [scaling_signal(ModelBacklog(40, 4, 0), windows, SETTINGS) for _ in range(2)]
    assert pool_wanted(burst, nodes=1, minimum=1, maximum=3) == 3
    assert pool_wanted(burst, nodes=2, minimum=1, maximum=8) == 2  # (2 x 44 x 21 ms + ...) / 0.7 = 2.7, halved


def test_the_signal_weighs_each_gpu_workers_window_by_its_jobs_and_falls_back_before_any():
    backlog = ModelBacklog(queued=10, held=2, frames=3)
    cold = scaling_signal(backlog, [], SETTINGS)
    assert (cold.cpu_ms, cold.cpu_ms_measured, cold.rate_per_s, cold.backlog) == (25.0, False, 0.0, 15)
    windows = [
        {"jobs": 30, "window_s": 60.0, "time_bill_ms": {"decode": {"mean": 8.0}, "resize": {"mean": 2.0}}},
        {"jobs": 90, "window_s": 30.0, "time_bill_ms": {"decode": {"mean": 16.0}, "resize": {"mean": 4.0}}},
    ]
    warm = scaling_signal(backlog, windows, SETTINGS)
    assert warm.cpu_ms_measured and warm.cpu_ms == pytest.approx((30 * 10 + 90 * 20) / 120)
    assert warm.rate_per_s == pytest.approx(0.5 + 3.0)
    assert warm.cpu_workers_wanted == wanted_workers(backlog, 3.5, warm.cpu_ms, SETTINGS)
    assert warm.to_json()["cpu_workers_wanted"] == warm.cpu_workers_wanted


def test_a_gpu_workers_window_counts_no_longer_than_it_has_run():
    from contract.workers.heartbeat import Heartbeat

    beat = Heartbeat.model_validate(
        {
            "worker_id": "g",
            "pid": 1,
            "host": "h",
            "started_at": 1000.0,
            "model": {"name": "m", "version": "1", "device": "sim", "stats": {"jobs": 50, "window_s": 60.0}},
        }
    )
    assert windows_of([beat], now=1010.0)["m:1"][0]["window_s"] == 10.0
    assert windows_of([beat], now=2000.0)["m:1"][0]["window_s"] == 60.0


def test_held_messages_are_counted_per_model_from_the_registered_workers_holds(redis_client):
    keys = Keys("held-count")
    assert model_of_queue("preprocess:m:1") == "m:1" and model_of_queue("preprocess:m:1@team-a") == "m:1"
    assert model_of_queue("callbacks") is None
    redis_client.zadd(keys.cpu_workers, {"w1": 1.0, "w2": 1.0})
    for holder, tag, queue in [
        ("w1", "a", "preprocess:m:1"),
        ("w1", "b", "preprocess:m:2@k"),
        ("w2", "c", "preprocess:m:1"),
    ]:
        redis_client.hset(keys.celery_holds(holder), tag, json.dumps([{}, "", queue, 1.0]))
    redis_client.hset(keys.celery_holds("w2"), "d", json.dumps([{}, "", "callbacks", 1.0]))
    redis_client.hset(keys.celery_holds("unregistered"), "e", json.dumps([{}, "", "preprocess:m:1", 1.0]))
    # What a take moved into a worker's held list: the message as it lay on its queue.
    taken = {"properties": {"delivery_tag": "f", "delivery_info": {"exchange": "", "routing_key": "preprocess:m:2"}}}
    redis_client.lpush(keys.celery_held("w2"), json.dumps(taken))
    redis_client.lpush(keys.celery_held("unregistered"), json.dumps(taken))
    assert held_by_model(redis_client, keys) == {"m:1": 2, "m:2": 2}


def _own_count(client: redis.Redis, keys: Keys, job_ids: list[str]) -> int:
    """Accepted jobs that no GPU worker has taken yet, from their own records."""
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(keys.job(job_id), "status")
    return sum(1 for status in pipe.execute() if status in (b"queued", b"preprocessing", b"queued_gpu"))


@pytest.fixture(scope="module")
def burst_stack(redis_server, tmp_path_factory) -> Iterator[Stack]:
    """The content-box pipeline in a Redis database and namespace of its own: this module kills its CPU worker."""
    workdir = tmp_path_factory.mktemp("burst")
    url = redis_server.url.rsplit("/", 1)[0] + "/11"
    stack = start_stack(url, workdir, content_box_spec(workdir, 64), "burst")
    yield stack
    stop_stack(stack)


@pytest.mark.integration
def test_during_a_burst_the_reported_backlog_follows_the_tests_own_count_and_ends_at_zero(burst_stack):
    """60 uploads at once with the GPU worker stopped (nothing is taken: frames pile up to the list's bound, the
    CPU workers prefetch and hold), the CPU worker killed and started again mid-way (its holds stay counted until
    they are given back), then the GPU worker started: at every look, /v1/stats' backlog is within 2 of the jobs
    the test finds not yet taken, read just before and just after it; 0 once every job is taken."""
    stack = burst_stack
    model = stack.settings.model.key
    stack.stop_gpu_worker()
    samples: list[tuple[int, int, int]] = []

    def look() -> None:
        before = _own_count(stack.redis, stack.keys, ids)
        reported = stack.session.get(stack.url("/v1/stats"), timeout=10).json()["scaling"][model]["backlog"]
        after = _own_count(stack.redis, stack.keys, ids)
        samples.append((before, reported, after))

    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(lambda i: stack.submit_ok(jpeg(320, 240, seed=9000 + i)), range(60)))
    try:
        for _ in range(8):
            look()
            time.sleep(0.25)
        stack.cpu_worker.stop(signal.SIGKILL)  # its holds stay registered until another worker reaps them
        for _ in range(4):
            look()
            time.sleep(0.25)
        stack.restart_cpu_worker()
        for _ in range(8):
            look()
            time.sleep(0.25)
    finally:
        if not stack.cpu_worker.alive():
            stack.restart_cpu_worker()
        stack.start_gpu_worker()
    for job_id in ids:
        assert stack.wait_terminal(job_id)["status"] == "succeeded"
    look()
    bad = [
        sample for sample in samples if not min(sample[0], sample[2]) - 2 <= sample[1] <= max(sample[0], sample[2]) + 2
    ]
    assert not bad, f"reported backlog off the test's own count (before, reported, after): {bad} of {samples}"
    assert samples[0][0] == 60 and samples[-1] == (0, 0, 0)
