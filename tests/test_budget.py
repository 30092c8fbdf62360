"""contract.admission.budget: the bytes of uploads and frames waiting in Redis, reserved before they are stored and
given back by whatever step drops them (real Redis)."""

from __future__ import annotations

import time

from contract.admission import budget
from contract.frames import frame_push as frames
from contract.frames.frame_shards import frame_pusher
from contract.jobs.handoff import JobHandOff
from contract.jobs.intake import JobIntake
from contract.jobs.record import SUCCEEDED
from contract.redis.keys import Keys

MODEL = "m:1"


def waiting(client, keys: Keys) -> dict[str, int]:
    return budget.WaitingBytes(client, keys).waiting()


def test_admission_checks_the_backlog_and_both_budgets_in_one_step_and_reserves(redis_client):
    keys = Keys("budget")
    counters = budget.WaitingBytes(redis_client, keys)
    assert counters.admit(MODEL, 600, 10, 1000, 1500) == (budget.ADMITTED, 0, 600, 600, 0, 0)
    assert counters.admit(MODEL, 600, 10, 1000, 1500).verdict == budget.OVER_MODEL_BYTES  # 1,200 > 1,000
    assert counters.admit("other:1", 1000, 10, 1000, 1500).verdict == budget.OVER_ALL_BYTES  # 1,600 > 1,500
    assert counters.admit("other:1", 900, 10, 1000, 1500) == (budget.ADMITTED, 0, 900, 1500, 0, 0)
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
    job_keys, job_args = store.finish_arguments([("a" * 32, SUCCEEDED, {"result": {"detections": []}})])
    assert (
        _WRITE_BATCH(
            redis_client,
            [
                keys.callback_outbox,
                keys.processing("w", MODEL),
                keys.gpu_counters("w"),
                keys.gpu_epoch("w"),
                keys.frames_waiting,
                "",
                *job_keys,
            ],
            [*store.finish_names(), 1, 300, MODEL, 0, "", 0, 0, *job_args],
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


def test_a_key_may_hold_only_its_share_of_each_byte_budget_and_the_others_still_get_in(redis_client):
    keys = Keys("budget-keys")
    counters = budget.WaitingBytes(redis_client, keys)

    def admit(model: str, size: int, owner: str) -> budget.BudgetVerdict:
        # budgets: 1,000 a model, 1,500 in all; a key's shares: 500 and 700
        return counters.admit(
            model, size, 10, 1000, 1500, owner=owner, max_owner_model_bytes=500, max_owner_all_bytes=700
        )

    assert admit(MODEL, 400, "a") == (budget.ADMITTED, 0, 400, 400, 400, 0)
    refused = admit(MODEL, 200, "a")  # 600 > its 500 (alone: the whole share)
    assert refused == (budget.OVER_KEY_MODEL_BYTES, 0, 400, 400, 400, 500)
    assert admit(MODEL, 450, "b").verdict == budget.ADMITTED  # another key: its own share
    # a key's share is of what the others leave: b's 450 leave a 700 x (1,500 - 450) / 1,500 = 490 of the total
    over_all = admit("other:1", 250, "a")  # 650 > 490
    assert over_all.verdict == budget.OVER_KEY_ALL_BYTES and (over_all.key_bytes, over_all.share) == (400, 490)
    assert admit("other:1", 90, "a").verdict == budget.ADMITTED  # 490
    assert counters.waiting("a") == {MODEL: 400, "other:1": 90, budget.ALL: 490}
    counters.release(MODEL, 400, owner="a")
    counters.release("other:1", 5000, owner="a")  # never below zero
    assert counters.waiting("a") == {MODEL: 0, "other:1": 0, budget.ALL: 0}
    assert admit("third:1", 900, "c").verdict == budget.ADMITTED  # nothing waiting: a share holds one of any size
    assert admit("third:1", 10, "c").verdict == budget.OVER_KEY_MODEL_BYTES
    assert counters.waiting("c") == {"third:1": 900, budget.ALL: 900}
    assert counters.waiting() == {MODEL: 450, "other:1": 0, "third:1": 900, budget.ALL: 1350}


def test_a_keys_bytes_leave_with_its_upload_whichever_step_drops_it(redis_client):
    """A key's bytes are its uploads: reserved with the model's, the form's own given back at the store, gone at
    the push (the frame's are the model's alone), at an end before the push, and at a push that finds the job
    over; nothing drifts."""
    keys = Keys("budget-key-flow")
    store = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60)
    pusher = frame_pusher(redis_client, keys)
    counters = budget.WaitingBytes(redis_client, keys)
    fields = {"model": MODEL, "deadline_at": time.time() + 60, "bytes": 1000, "owner": "a"}

    def admit(size: int) -> None:
        verdict = counters.admit(MODEL, size, 10, 10**6, 10**6, owner="a", max_owner_model_bytes=10**5)
        assert verdict.verdict == budget.ADMITTED

    admit(1200)  # a multipart body of 1,200
    store.create("a" * 32, b"u" * 1000, 60, fields, reserved=1200)
    assert counters.waiting("a") == {MODEL: 1000, budget.ALL: 1000}  # the form's 200 given back
    assert handoff.claim_for_preprocessing("a" * 32, time.time(), "c")[0] == "claimed"
    assert pusher.push("a" * 32, MODEL, b"f" * 300, 10, {}, "c") == frames.PUSHED
    assert counters.waiting("a") == {MODEL: 0, budget.ALL: 0}  # its upload is gone
    assert waiting(redis_client, keys) == {MODEL: 300, budget.ALL: 300}  # the frame is the model's

    admit(1000)
    store.create("b" * 32, b"u" * 1000, 60, fields, reserved=1000)
    assert store.fail("b" * 32, "cancelled", "ended before its push")
    assert counters.waiting("a") == {MODEL: 0, budget.ALL: 0}

    admit(1000)
    store.create("c" * 32, b"u" * 1000, 60, fields, reserved=1000)
    assert handoff.claim_for_preprocessing("c" * 32, time.time(), "c")[0] == "claimed"
    redis_client.hset(keys.job("c" * 32), "status", "cancelled")  # ended by a version that kept its upload
    assert pusher.push("c" * 32, MODEL, b"f" * 300, 10, {}, "c") == frames.JOB_OVER
    assert counters.waiting("a") == {MODEL: 0, budget.ALL: 0}
    assert waiting(redis_client, keys) == {MODEL: 300, budget.ALL: 300}
