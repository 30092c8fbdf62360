"""contract.budget: the bytes of uploads and frames waiting in Redis, reserved before they are stored and
given back by whatever step drops them (real Redis)."""

from __future__ import annotations

import time

from contract import budget
from contract import frame_push as frames
from contract.frame_shards import frame_pusher
from contract.jobs.handoff import JobHandOff
from contract.jobs.intake import JobIntake
from contract.jobs.record import SUCCEEDED
from contract.keys import Keys

MODEL = "m:1"


def waiting(client, keys: Keys) -> dict[str, int]:
    return budget.WaitingBytes(client, keys).waiting()


def test_admission_checks_the_backlog_and_both_budgets_in_one_step_and_reserves(redis_client):
    keys = Keys("budget")
    counters = budget.WaitingBytes(redis_client, keys)
    assert counters.admit(MODEL, 600, 10, 1000, 1500) == (budget.ADMITTED, 0, 600, 600)
    assert counters.admit(MODEL, 600, 10, 1000, 1500).verdict == budget.OVER_MODEL_BYTES  # 1,200 > 1,000
    assert counters.admit("other:1", 1000, 10, 1000, 1500).verdict == budget.OVER_ALL_BYTES  # 1,600 > 1,500
    assert counters.admit("other:1", 900, 10, 1000, 1500) == (budget.ADMITTED, 0, 900, 1500)
    redis_client.rpush(keys.frames(MODEL), b"f1", b"f2")
    assert counters.admit(MODEL, 0, 2, 1000, 1500).verdict == budget.OVER_BACKLOG  # two jobs waiting
    redis_client.delete(keys.frames(MODEL))
    redis_client.hset(keys.frames_waiting, MODEL, 2)  # on bulk shards
    assert counters.admit(MODEL, 0, 2, 1000, 1500).verdict == budget.OVER_BACKLOG
    counters.release(MODEL, 600)
    counters.release("other:1", 5000)  # never below zero
    assert counters.waiting() == {MODEL: 0, "other:1": 0, budget.ALL: 0}


def test_every_step_that_drops_bytes_gives_them_back(redis_client):
    """Reserved at admission, the upload's bytes leave at the push and the frame's enter; the frame's leave
    when the GPU worker writes its batch; an upload still there when the job ends leaves with it."""
    from gpu_worker.finish import _WRITE_BATCH

    keys = Keys("budget-flow")
    store = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60)
    pusher = frame_pusher(redis_client, keys)
    counters = budget.WaitingBytes(redis_client, keys)
    fields = {"model": MODEL, "deadline_at": time.time() + 60, "bytes": 1000}
    assert counters.admit(MODEL, 1200, 10, 10**6, 10**6).verdict == budget.ADMITTED  # a multipart body of 1,200
    store.create("a" * 32, b"u" * 1000, 60, fields, reserved=1200)
    assert waiting(redis_client, keys) == {MODEL: 1000, budget.ALL: 1000}  # the form's 200 given back
    assert handoff.claim_for_preprocessing("a" * 32, time.time(), "c")[0] == "claimed"
    assert pusher.push("a" * 32, MODEL, b"f" * 300, 10, {}, "c") == frames.PUSHED
    assert waiting(redis_client, keys) == {MODEL: 300, budget.ALL: 300}  # upload out, frame in
    redis_client.lmove(keys.frames(MODEL), keys.processing("w", MODEL), "RIGHT", "LEFT")
    write = redis_client.register_script(_WRITE_BATCH)
    job_keys, job_args = store.finish_arguments([("a" * 32, SUCCEEDED, {"result": {"detections": []}})])
    assert (
        write(
            keys=[
                keys.callback_outbox,
                keys.processing("w", MODEL),
                keys.gpu_counters("w"),
                keys.gpu_epoch("w"),
                keys.frames_waiting,
                *job_keys,
            ],
            args=[*store.finish_names(), 1, 300, MODEL, 0, "", *job_args],
        )
        == 1
    )
    assert waiting(redis_client, keys) == {MODEL: 0, budget.ALL: 0}
    assert redis_client.llen(keys.processing("w", MODEL)) == 0

    assert counters.admit(MODEL, 1000, 10, 10**6, 10**6).verdict == budget.ADMITTED
    store.create("b" * 32, b"u" * 1000, 60, fields, reserved=1000)
    assert store.fail("b" * 32, "cancelled", "ended before its push")  # the upload goes with it
    assert waiting(redis_client, keys) == {MODEL: 0, budget.ALL: 0}
    assert store.fail("b" * 32, "again", "a second end changes nothing") is False
    assert waiting(redis_client, keys) == {MODEL: 0, budget.ALL: 0}
