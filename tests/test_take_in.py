"""The intake in one step (contract.jobs.intake's take_in, the library's `take_in`): the lookup, the admission, the
decode charge and the job in one round trip to the control plane, and whatever refuses a submission leaves nothing
of it behind, there or on its bulk shard. Real redis-servers of the test's own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from bench.stack.processes import RedisServer
from contract.admission import budget
from contract.jobs.intake import Created, DecodeCharge, DecodeRefused, HitTerms, JobIntake, NewJob
from contract.jobs.record import QUEUED, SUCCEEDED
from contract.library import ensure_library
from contract.redis.keys import Keys
from contract.redis.shards import SHARDED_UPLOAD, UPLOAD_FIELD, BulkPlane
from tests.support import wait_until

MODEL = "m:1"
UPLOAD = b"the upload" * 10


@pytest.fixture
def servers(tmp_path) -> Iterator[tuple[redis.Redis, redis.Redis]]:
    """A control plane and a bulk shard, each a redis-server of this test's alone (INFO's counts are the server's)."""
    for name in ("control", "shard"):
        (tmp_path / name).mkdir()
    control, shard = RedisServer(tmp_path / "control"), RedisServer(tmp_path / "shard")
    clients = redis.Redis(port=control.port), redis.Redis(port=shard.port)
    yield clients
    for client in clients:
        client.close()
    control.stop()
    shard.stop()


def request(size: int = len(UPLOAD), backlog: int = 10, owner: str = "") -> budget.AdmissionRequest:
    return budget.AdmissionRequest(
        MODEL, size, backlog, 10_000, 10_000, sharded=False, owner=owner, max_owner_model_bytes=10_000,
        max_owner_all_bytes=10_000,
    )  # fmt: skip


def new_job(keys: Keys, job_id: str, admission: budget.AdmissionRequest | None, **more: Any) -> NewJob:
    fields = {"model": MODEL, "received_at": 1.0, "deadline_at": 1e12, "bytes": len(UPLOAD), **more.pop("fields", {})}
    task = (keys.celery_queue(keys.preprocess_queue(MODEL, "")), b"the task")
    return NewJob(job_id, UPLOAD, 60, fields, task, admission, **more)


def nothing_of(client: redis.Redis, keys: Keys, job_id: str, shard: redis.Redis | None = None) -> dict[str, Any]:
    """What the control plane (and the shard) hold of a job: all empty when a refusal kept nothing."""
    held = {
        "record": client.exists(keys.job(job_id)),
        "deadline": client.zscore(keys.deadlines, job_id),
        "task": client.llen(keys.celery_queue(keys.preprocess_queue(MODEL, ""))),
        "upload": client.exists(keys.upload(job_id)),
        "bytes": {k.decode(): int(v) for k, v in client.hgetall(keys.waiting_bytes).items() if int(v)},
        "charges": client.hlen(keys.decode_share),
    }
    if shard is not None:
        held["shard upload"] = shard.exists(keys.upload(job_id))
    return held


EMPTY = {"record": 0, "deadline": None, "task": 0, "upload": 0, "bytes": {}, "charges": 0}


def test_a_job_taken_in_costs_the_control_plane_one_round_trip(servers):
    """Without a shard: MULTI, the upload's SETEX, the step's FCALL, EXEC: one round trip (it was the admission's
    FCALL, then the job's MULTI). The job is as create made it, its bytes reserved."""
    control, _ = servers
    keys = Keys("one-trip")
    intake = JobIntake(control, keys, ttl_s=60)
    ensure_library(control)
    control.config_resetstat()
    taken = intake.take_in(new_job(keys, "a1" * 16, request()))
    assert isinstance(taken, Created) and taken.verdict is None  # take_in_job's 1: made, no figures sent
    stats = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in control.info("commandstats").items()}
    top = {name: stats.get(name, 0) for name in ("multi", "exec", "setex", "fcall")}
    assert top == {"multi": 1, "exec": 1, "setex": 1, "fcall": 1}, stats
    assert "eval" not in stats and "evalsha" not in stats and stats["hset"] == 1, stats
    record = intake.load("a1" * 16)
    assert record is not None and record["status"] == QUEUED and record["model"] == MODEL
    assert control.get(keys.upload("a1" * 16)) == UPLOAD
    assert control.ttl(keys.job("a1" * 16)) > 60  # until its deadline, then the records' TTL
    assert control.zscore(keys.deadlines, "a1" * 16) == 1e12
    assert control.lrange(keys.celery_queue(keys.preprocess_queue(MODEL, "")), 0, -1) == [b"the task"]
    assert int(control.hget(keys.waiting_bytes, MODEL)) == len(UPLOAD)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_refused_upload_leaves_nothing_behind_on_the_control_plane_or_its_shard(servers, sharded):
    control, shard = servers
    keys = Keys("refused")
    bulk = BulkPlane(control, [shard]) if sharded else None
    intake = JobIntake(control, keys, ttl_s=60, bulk=bulk)
    ensure_library(control)
    control.lpush(keys.frames(MODEL), b"someone else's frame")  # the model's backlog: 1 of 1
    refused = intake.take_in(new_job(keys, "b1" * 16, request(backlog=1)))
    assert isinstance(refused, budget.BudgetVerdict) and refused.verdict == budget.OVER_BACKLOG
    control.delete(keys.frames(MODEL))
    assert nothing_of(control, keys, "b1" * 16, shard) == {**EMPTY, "shard upload": 0}
    # and admitted when there is room: the upload where it belongs
    assert isinstance(intake.take_in(new_job(keys, "b2" * 16, request())), Created)
    expected = SHARDED_UPLOAD.decode() if sharded else QUEUED
    assert intake.load("b2" * 16)[UPLOAD_FIELD if sharded else "status"] == expected
    on = shard if sharded else control
    assert on.get(keys.upload("b2" * 16)) == UPLOAD


def test_a_refused_decode_charge_gives_back_the_bytes_its_step_reserved(servers):
    """The admission took the bytes, the decode charge refused: the same step gives them back (the key's too)."""
    control, _ = servers
    keys = Keys("decode")
    intake = JobIntake(control, keys, ttl_s=60)
    ensure_library(control)
    charge = DecodeCharge(cost=40, share=50, lapse_at=1e12)
    owner = {"fields": {"owner": "team-a"}}
    first = intake.take_in(new_job(keys, "c1" * 16, request(owner="team-a"), decode=charge, **owner))
    assert isinstance(first, Created)
    before = nothing_of(control, keys, "c2" * 16)
    key_bytes = control.hgetall(keys.key_waiting_bytes("team-a"))
    refused = intake.take_in(new_job(keys, "c2" * 16, request(owner="team-a"), decode=charge, **owner))
    assert refused == DecodeRefused(40)
    assert nothing_of(control, keys, "c2" * 16) == before  # the first job's alone: its bytes, task, charge
    assert before["bytes"] == {MODEL: len(UPLOAD)} and before["charges"] == 1
    assert control.hgetall(keys.key_waiting_bytes("team-a")) == key_bytes


def test_a_hit_keeps_no_upload_and_a_miss_is_admitted_in_the_same_step(servers):
    from contract.jobs.hits import HitLimits

    control, shard = servers
    keys = Keys("hits")
    intake = JobIntake(control, keys, ttl_s=60, bulk=BulkPlane(control, [shard]), hits=HitLimits(10**6, 60, 600))
    ensure_library(control)
    control.set(keys.cache_entry("d"), '{"detections":[]}', ex=60)
    terms = HitTerms("d", 60, {"model": MODEL, "received_at": 1.0, "deadline_at": 1e12}, {"total": 1.0}, "team-a")
    hit = intake.take_in(new_job(keys, "d1" * 16, request()), terms)
    assert hit.status == SUCCEEDED and hit.document == '{"detections":[]}'  # type: ignore[union-attr]
    assert not shard.exists(keys.upload("d1" * 16)) and not control.hget(keys.waiting_bytes, MODEL)
    missed = intake.take_in(new_job(keys, "d2" * 16, request()), terms._replace(digest="other"))
    assert isinstance(missed, Created) and shard.get(keys.upload("d2" * 16)) == UPLOAD
    assert int(control.hget(keys.waiting_bytes, MODEL)) == len(UPLOAD)


def test_a_redis_that_lost_the_library_takes_the_job_in_once_and_a_refused_one_not_at_all(servers):
    """Without the library the transaction's writes land and its step does not: the library is loaded and the step
    called alone, which finds the job's message by its value (another may have been pushed above it meanwhile)."""
    control, _ = servers
    keys = Keys("lost")
    intake = JobIntake(control, keys, ttl_s=60)
    queue = keys.celery_queue(keys.preprocess_queue(MODEL, ""))
    ensure_library(control)
    control.function_flush()
    assert isinstance(intake.take_in(new_job(keys, "e1" * 16, request())), Created)
    assert control.lrange(queue, 0, -1) == [b"the task"]
    assert int(control.hget(keys.waiting_bytes, MODEL)) == len(UPLOAD)
    control.function_flush()
    control.lpush(keys.frames(MODEL), *[b"frame"] * 9)  # the backlog: 10 of 10 with the first job
    refused = intake.take_in(new_job(keys, "e2" * 16, request()))
    assert isinstance(refused, budget.BudgetVerdict) and refused.verdict == budget.OVER_BACKLOG
    assert control.lrange(queue, 0, -1) == [b"the task"]  # the first job's, once
    assert not control.exists(keys.job("e2" * 16), keys.upload("e2" * 16))
    assert int(control.hget(keys.waiting_bytes, MODEL)) == len(UPLOAD)


def test_an_api_that_dies_between_the_shard_and_the_step_leaves_an_upload_that_lapses_and_nothing_else(servers):
    """The upload is stored on its shard before the step: an API killed then (here, while the control plane holds
    its writes) leaves that upload alone, with its TTL, and nothing on the control plane: no record, no bytes."""
    control, shard = servers
    keys = Keys("dead-api")
    ensure_library(control)
    control_port = control.connection_pool.connection_kwargs["port"]
    shard_port = shard.connection_pool.connection_kwargs["port"]
    script = textwrap.dedent(f"""
        import redis
        from contract.admission import budget
        from contract.jobs.intake import JobIntake, NewJob
        from contract.redis.keys import Keys
        from contract.redis.shards import BulkPlane
        control, shard = redis.Redis(port={control_port}), redis.Redis(port={shard_port})
        keys = Keys("dead-api")
        intake = JobIntake(control, keys, ttl_s=60, bulk=BulkPlane(control, [shard]))
        request = budget.AdmissionRequest({MODEL!r}, 100, 10, 10_000, 10_000, sharded=False)
        fields = {{"model": {MODEL!r}, "deadline_at": 1e12, "bytes": 100}}
        intake.take_in(NewJob("f1" * 16, b"u" * 100, 30, fields, ("q", b"t"), request))
    """)
    control.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    api = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_until(lambda: shard.exists(keys.upload("f1" * 16)), 30, what="the upload on its shard")
        wait_until(lambda: _blocked_clients(control) >= 1, 30, what="the step held by the paused control plane")
        api.kill()
        api.wait(30)
    finally:
        control.execute_command("CLIENT", "UNPAUSE")
        if api.poll() is None:
            api.kill()
    # The killed connection's FCALL is dropped with it: nothing on the control plane, the upload lapses.
    wait_until(lambda: _blocked_clients(control) == 0, 30, what="the paused command dropped")
    assert nothing_of(control, keys, "f1" * 16) == EMPTY and not control.llen("q")
    assert 0 < shard.ttl(keys.upload("f1" * 16)) <= 30


def _blocked_clients(client: redis.Redis) -> int:
    return int(client.info("clients")["blocked_clients"])
