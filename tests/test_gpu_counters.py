"""The GPU worker's counters hash (Keys.gpu_counters): written by its heartbeat's step, which finds its epoch first,
not with every batch write (issue 72); each model's frames answered stay the batch write's (the drain rate's).

Real redis-server; the heartbeat's own class (gpu_worker.heartbeat.Liveness) and the batch write's step."""

from __future__ import annotations

import socket

import redis

from contract.jobs.ending import JobEnding
from contract.jobs.record import SUCCEEDED
from contract.library import Step
from contract.redis.keys import Keys, model_frames_total
from contract.settings.config import load_settings
from contract.workers.heartbeat import Heartbeat, HeartbeatModel
from gpu_worker.heartbeat import Liveness
from gpu_worker.host_time import HostTime, worker_counters
from gpu_worker.stats import BusyMeter, RecentStats

MODEL = "m:1"
_WRITE_BATCH = Step("write_batch")


def _liveness(client: redis.Redis, keys: Keys, counters: dict[str, float]) -> Liveness:
    def describe() -> Heartbeat:
        model = HeartbeatModel(name="m", version="1", device="sim")
        return Heartbeat(worker_id="w", pid=1, host=socket.gethostname(), started_at=0.0, model=model, models=[model])

    return Liveness(
        load_settings(None), client, keys, "w", describe, lambda: float("inf"), lambda: 0.0, counters=lambda: counters
    )


def test_a_beat_writes_the_workers_counters_and_a_fenced_worker_writes_none(redis_client):
    keys = Keys("gpu-counters")
    recent = RecentStats()
    recent.record_batch(4)
    counters = worker_counters(BusyMeter(60.0), recent, [HostTime()])
    assert counters["frames_total"] == 4 and counters["batches_total"] == 1 and "host_wall_s:forward" in counters
    liveness = _liveness(redis_client, keys, counters)
    liveness.begin_epoch()
    liveness.beat()
    assert not liveness.presumed_dead
    written = redis_client.hgetall(keys.gpu_counters("w"))
    assert float(written[b"frames_total"]) == 4 and float(written[b"batches_total"]) == 1, written
    counters["frames_total"] = 6  # a worker that stops writes its last counters as it leaves
    liveness.leave()
    assert float(redis_client.hget(keys.gpu_counters("w"), "frames_total")) == 6
    assert not redis_client.exists(keys.gpu_epoch("w"))
    liveness.begin_epoch()  # its next life
    counters["frames_total"] = 4
    liveness.beat()
    assert float(redis_client.hget(keys.gpu_counters("w"), "frames_total")) == 4

    # A reaper took its frames (a new epoch: gpu_worker.heartbeat): the next beat, and its leaving, write nothing.
    redis_client.set(keys.gpu_epoch("w"), "another life")
    counters["frames_total"] = 12
    liveness.beat()
    assert liveness.presumed_dead
    liveness.leave()
    assert float(redis_client.hget(keys.gpu_counters("w"), "frames_total")) == 4
    assert not redis_client.exists(keys.heartbeat("w"))


def test_a_batch_write_counts_its_models_frames_alone_and_a_fenced_one_writes_nothing(redis_client):
    keys = Keys("gpu-counters-batch")
    store = JobEnding(redis_client, keys, 600)
    redis_client.set(keys.gpu_epoch("w"), "mine")

    def write(job_id: str, epoch: str, frames_total: int) -> int:
        redis_client.hset(keys.job(job_id), mapping={"status": "running", "model": MODEL})
        redis_client.lpush(keys.processing("w", MODEL), b"frame")
        job_keys, job_args = store.finish_arguments([(job_id, SUCCEEDED, {"result": {"detections": []}})])
        counters = [model_frames_total(MODEL), frames_total]
        return int(
            _WRITE_BATCH(
                redis_client,
                [keys.callback_outbox, keys.processing("w", MODEL), keys.gpu_counters("w"), keys.gpu_epoch("w")]
                + [keys.frames_waiting, "", *job_keys],
                [*store.finish_names(), 1, 5, MODEL, len(counters), epoch, 0, *counters, *job_args],
            )
        )

    assert write("a" * 32, "mine", 1) == 1
    assert redis_client.hgetall(keys.gpu_counters("w")) == {model_frames_total(MODEL).encode(): b"1"}
    assert write("b" * 32, "a life before", 2) == -1  # fenced: not its frames any more
    assert redis_client.hgetall(keys.gpu_counters("w")) == {model_frames_total(MODEL).encode(): b"1"}
    assert redis_client.hget(keys.job("b" * 32), "status") == b"running"
