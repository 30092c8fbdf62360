"""The job's life in one Redis function library (contract.library): loaded once, checked by every process, kept
by Redis across a restart, loaded again by the one recovery where a Redis comes back empty."""

from __future__ import annotations

import json
import re
from pathlib import Path

import redis

from contract.admission.budget import ALL
from contract.admission.token_bucket import TokenBuckets
from contract.cache import ENTRY_OVERHEAD, STALE_PER_ENTRY
from contract.frames import _PREFIX, MAGIC
from contract.frames.frame_push import JOB_OVER, KEY_FRAMES_TTL_S, LIST_FULL, PUSHED, FramePusher
from contract.jobs.ending import FINISH_NAMES, LATE_ERROR, PENDING_CALLBACK, JobEnding
from contract.jobs.hits import HIT_GONE
from contract.jobs.record import TERMINAL, JobStatus
from contract.jobs.timebill import CPU_STARTED_AT
from contract.library import (
    FILES,
    HERE,
    ensure_library,
    library_source,
    library_version,
    loaded_code,
    loaded_version,
)
from contract.redis.keys import ANSWER_DEBT_SUFFIX, KEY_WAITING_SEPARATOR, UPLOAD_SUFFIX, Keys
from contract.redis.shards import SHARDED_UPLOAD, UPLOAD_FIELD
from tasks.callbacks.delivery import DEAD_LETTER_DROPS
from tests.support import RedisServer

LIBRARY = HERE


def _lua(name: str) -> str:
    return (LIBRARY / name).read_text()


def _job(client: redis.Redis, keys: Keys, job_id: str) -> None:
    client.hset(keys.job(job_id), mapping={"status": JobStatus.RUNNING.value, "model": "m:1"})


def test_every_lua_file_of_the_home_is_in_the_library_and_it_opens_with_its_name():
    assert sorted(path.name for path in LIBRARY.glob("*.lua")) == sorted(FILES)
    assert library_source().startswith("#!lua name=imgserve\n")


def test_the_librarys_literals_are_the_contracts():
    terminal = re.search(r"^local TERMINAL = \{(.*)\}$", _lua("head.lua"), re.MULTILINE)
    assert terminal and set(re.findall(r"(\w+) = true", terminal.group(1))) == {str(s) for s in TERMINAL}
    ending = _lua("ending.lua")
    assert f"local UPLOAD_SUFFIX = '{UPLOAD_SUFFIX}'" in ending
    assert f"local SHARDED_UPLOAD, UPLOAD_FIELD = '{SHARDED_UPLOAD.decode()}', '{UPLOAD_FIELD}'" in ending
    assert f"local PENDING_CALLBACK = '{PENDING_CALLBACK}'" in ending
    deadlines = _lua("deadlines.lua")  # expiry's library side (contract.jobs.expiry)
    assert f"local LATE_ERROR = '{LATE_ERROR}'" in deadlines
    assert f"local FINISH_NAMES = {FINISH_NAMES}" in ending
    assert f"local SUCCEEDED, EXPIRED = '{JobStatus.SUCCEEDED.value}', '{JobStatus.EXPIRED.value}'" in deadlines
    assert "local PUSHED = {[QUEUED_GPU] = true, [RUNNING] = true}" in ending
    assert f"local ENTRY_OVERHEAD, STALE_PER_ENTRY = {ENTRY_OVERHEAD}, {STALE_PER_ENTRY}" in _lua("cache.lua")
    assert f"local FRAME_PREFIX_BYTES = {_PREFIX.size}" in _lua("frames.lua") and len(MAGIC) == 4
    assert "struct.unpack('>I4', string.sub(frame, 5, FRAME_PREFIX_BYTES))" in _lua("frames.lua")
    drops = re.search(r"^local DEAD_LETTER_DROPS = \{(.*?)\}$", _lua("callbacks.lua"), re.MULTILINE | re.DOTALL)
    assert drops and re.findall(r"'(\w+)'", drops.group(1)) == list(DEAD_LETTER_DROPS)
    head = _lua("head.lua")
    for status in ("QUEUED", "PREPROCESSING", "QUEUED_GPU", "RUNNING"):
        assert re.search(rf"\b{status}\b.* = .*'{JobStatus[status].value}'", head), status
    push = _lua("push.lua")
    assert f"local PUSHED, LIST_FULL, JOB_OVER = {PUSHED}, {LIST_FULL}, {JOB_OVER}" in push
    assert f"local CPU_STARTED_AT = '{CPU_STARTED_AT}'" in _lua("handoff.lua")
    assert f"local KEY_FRAMES_TTL_S = '{KEY_FRAMES_TTL_S}'" in _lua("handoff.lua")
    # the end of a claimed job names its key's count from the job's hash (ending.lua's count_out_claimed)
    keys, job = Keys("ns"), "ab" * 16
    job_infix, key_frames_infix = keys.job(job)[2:-32], keys.key_frames_prefix[2:]
    assert f"local JOB_INFIX, KEY_FRAMES_INFIX = '{job_infix}', '{key_frames_infix}'" in ending
    assert f"local ALL = '{ALL}'" in _lua("admission.lua")
    assert f"local HIT_GONE = '{HIT_GONE}'" in _lua("hits.lua")
    assert f"local KEY_WAITING_SEPARATOR = '{KEY_WAITING_SEPARATOR}'" in _lua("budget.lua")
    assert f"local DEBT_SUFFIX = '{ANSWER_DEBT_SUFFIX}'" in _lua("token_bucket.lua")


def test_a_redis_without_the_library_gets_it_and_an_older_one_is_replaced(redis_client: redis.Redis):
    redis_client.function_flush()
    assert loaded_version(redis_client) is None
    assert ensure_library(redis_client) == library_version() == loaded_version(redis_client)
    older = library_source().replace(f"local VERSION = {library_version()}", "local VERSION = 0", 1)
    redis_client.function_load(older, replace=True)
    assert loaded_version(redis_client) == 0
    assert ensure_library(redis_client) == library_version() == loaded_version(redis_client)


def test_a_newer_library_stays_loaded(redis_client: redis.Redis):
    newer_version = library_version() + 1
    newer = library_source().replace(f"local VERSION = {library_version()}", f"local VERSION = {newer_version}", 1)
    try:
        redis_client.function_load(newer, replace=True)
        assert ensure_library(redis_client) == newer_version == loaded_version(redis_client)
    finally:
        redis_client.function_load(library_source(), replace=True)


def test_a_step_on_a_redis_that_came_back_empty_loads_the_library_and_runs_once(redis_client: redis.Redis):
    keys = Keys()
    ending = JobEnding(redis_client, keys, ttl_s=60)
    _job(redis_client, keys, "j1")
    redis_client.function_flush()  # a Redis restarted without its data, or a replica that never had the library
    assert ending.finish("j1", JobStatus.FAILED.value, {"error": {"code": "x", "message": "y"}})
    assert loaded_version(redis_client) == library_version()
    assert redis_client.hget(keys.job("j1"), "status") == JobStatus.FAILED.value.encode()
    assert not ending.finish("j1", JobStatus.SUCCEEDED.value)  # the first end won, once


def test_a_redis_restarted_from_its_append_only_file_keeps_the_library(tmp_path: Path):
    server = RedisServer(tmp_path, persistent=True)
    try:
        client = redis.Redis(port=server.port)
        ensure_library(client)
        keys = Keys()
        _job(client, keys, "j1")
        server.stop()
        server.start()
        client = redis.Redis(port=server.port)
        # FCALL itself, not the facade: nothing may load the library again for this to answer
        names = JobEnding(client, keys, ttl_s=60).finish_names()
        job_arguments = ("j1", 2, "status", "failed")
        ended = client.fcall("finish_jobs", 2, keys.callback_outbox, keys.job("j1"), *names, *job_arguments)  # type: ignore[no-untyped-call]
        assert ended == 1
        assert client.hget(keys.job("j1"), "status") == b"failed"
    finally:
        server.stop()


def test_the_same_version_with_other_code_is_replaced_by_the_step_that_misses_a_function(redis_client: redis.Redis):
    """A checkout between two versions: its library's code is another, its version the same."""
    other = library_source().split("\nredis.register_function('take_token'", 1)[0]  # the steps after it missing
    redis_client.function_load(other, replace=True)
    buckets = TokenBuckets(redis_client)
    assert buckets.take("bucket:library-test", rate_per_s=1.0, burst=2.0).allowed
    assert loaded_code(redis_client) == library_source()


def test_no_script_or_script_loading_path_is_left_in_the_product():
    """Every step of a job's life is a library function: no script registered, sent by SHA, or loaded again."""
    root = Path(__file__).resolve().parents[1]
    words = (
        "register_script",
        "EVALSHA",
        "evalsha",
        "NoScriptError",
        "NOSCRIPT",
        "script_load",
        "pipe.eval(",
        '"EVAL"',
    )
    found = [
        f"{path.relative_to(root)}: {word}"
        for package in ("app", "tasks", "gpu_worker", "contract")
        for path in sorted((root / package).rglob("*.py"))
        for word in words
        if word in path.read_text()
    ]
    assert not found, found


def test_a_push_into_a_redis_that_came_back_empty_stands_once(redis_client: redis.Redis):
    """The push's step runs inside a MULTI, after the frame's LPUSH: a Redis without the library answers there,
    and the frame is taken back before the push is made again (one frame, not two)."""
    keys = Keys("library-push")
    job = keys.job("p" * 32)
    redis_client.hset(job, mapping={"status": JobStatus.PREPROCESSING.value, "model": "m:1", "bytes": 10})
    redis_client.set(keys.upload("p" * 32), b"u" * 10)
    redis_client.function_flush()
    pushed = FramePusher(redis_client, keys).push("p" * 32, "m:1", b"frame", 8, {"pushed_at": 1.0})
    assert pushed == PUSHED
    assert redis_client.lrange(keys.frames("m:1"), 0, -1) == [b"frame"]
    assert redis_client.hget(job, "status") == JobStatus.QUEUED_GPU.value.encode()
    assert loaded_version(redis_client) == library_version()


def test_claim_job_answers_a_claim_with_its_count_alone_and_claim_as_library_9_did(redis_client: redis.Redis):
    """`claim_job` (this release's CPU workers) answers a claimed job with its key's frames, an integer; `claim`,
    as a CPU worker of library version 9 calls it beside this library, still answers {'claimed', frames}; either
    answers the other verdicts with a string, and both count a keyed job in once."""
    keys = Keys("library-claim")
    ensure_library(redis_client)
    for job_id, owner in (("k1" * 16, "flood"), ("k2" * 16, "flood"), ("n1" * 16, "")):
        redis_client.hset(keys.job(job_id), mapping={"status": "queued", "model": "m:1", "owner": owner})
    redis_client.hset(keys.job("ov" * 16), mapping={"status": "succeeded", "model": "m:1"})
    prefix = keys.key_frames_prefix

    def both(name: str, job_id: str) -> object:
        return redis_client.fcall(name, 1, keys.job(job_id), "1.0", "c", prefix)  # type: ignore[no-untyped-call]

    assert both("claim_job", "k1" * 16) == 0
    assert both("claim", "k2" * 16) == [b"claimed", 1]
    assert both("claim_job", "k2" * 16) == 1  # claimed again (a redelivered task): the count read, not raised
    assert both("claim", "k1" * 16) == [b"claimed", 1]
    assert redis_client.hget(keys.key_frames("m:1"), "flood") == b"2"
    assert both("claim_job", "n1" * 16) == -1 and both("claim", "n1" * 16) == [b"claimed", -1]
    assert both("claim_job", "ov" * 16) == b"over" and both("claim", "ov" * 16) == b"over"
    assert both("claim_job", "no" * 16) == b"missing" and both("claim", "no" * 16) == b"missing"


def test_an_end_writes_the_fields_as_sent_and_a_late_callback_or_marked_one_as_before(redis_client: redis.Redis):
    """The end's HSET takes a job's fields straight from the step's arguments unless something is added to them: an
    answer after the deadline (ended `expired`, its result dropped, the late error added), a callback (its pending
    state, the outbox), an upload marker on a shard (cleared). Each shape ends its job once, in one step."""
    import time

    keys = Keys("library-end")
    ensure_library(redis_client)
    ending = JobEnding(redis_client, keys, ttl_s=60)
    now = time.time()
    live = {"status": JobStatus.RUNNING.value, "model": "m:1", "deadline_at": repr(now + 60)}
    redis_client.hset(keys.job("plain"), mapping=live)
    redis_client.hset(keys.job("late"), mapping={**live, "deadline_at": repr(now - 1)})
    redis_client.hset(keys.job("called"), mapping={**live, "callback_url": "http://127.0.0.1:9/hook"})
    redis_client.hset(keys.job("marked"), mapping={**live, "status": "preprocessing", UPLOAD_FIELD: SHARDED_UPLOAD})
    answer = {"result": {"detections": []}, "timings": {"total": 1.0}}
    outcomes = [(job_id, "succeeded", answer) for job_id in ("plain", "late", "called", "marked")]
    assert ending.finish_many(outcomes) == 4
    assert ending.finish_many(outcomes) == 0  # the first end wins
    plain, late = ending.load("plain"), ending.load("late")
    assert plain["status"] == "succeeded" and plain["result"] == {"detections": []} and "callback" not in plain
    assert late["status"] == "expired" and "result" not in late and late["error"] == json.loads(LATE_ERROR)
    assert late["timings"] == {"total": 1.0}  # the other fields kept
    called = ending.load("called")
    assert called["status"] == "succeeded" and called["callback"] == json.loads(PENDING_CALLBACK)
    assert redis_client.lrange(keys.callback_outbox, 0, -1) == [b"called"]
    marked = redis_client.hgetall(keys.job("marked"))
    assert marked[b"status"] == b"succeeded" and marked[UPLOAD_FIELD.encode()] == b""
