"""One clock (contract.redis.clock, contract.jobs.deadlines): every moment a job carries is the Redis primary's,
whatever the wall clock of the host that writes or judges it says; job ids tell when they were issued (a lost job
answers 410). A real redis-server; the host clock moved by the clock's own `wall` argument."""

from __future__ import annotations

import time

import pytest
import redis

from contract.jobs.deadlines import deadline_at, is_past, seconds_left
from contract.jobs.record import JOB_ID_PATTERN, issued_at, lost_at, new_job_id
from contract.library import HERE as LIBRARY
from contract.redis import clock as clock_module
from contract.redis.clock import ServiceClock

# The library's own judgement (contract/library/deadlines.lua), run alone as a script.
DEADLINE_PASSED_LUA = (LIBRARY / "deadlines.lua").read_text()


def test_a_clock_bound_to_redis_reads_redis_time_whatever_the_host_clock_says(redis_client: redis.Redis):
    ahead = ServiceClock(wall=lambda: time.time() + 8.0)  # a host 8 s ahead, as the GPU host of issue 51
    assert ahead.now() == pytest.approx(time.time() + 8.0, abs=0.05)  # unbound: the host's own
    assert not ahead.synced
    ahead.follow(redis_client)
    assert ahead.synced
    seconds, micros = redis_client.time()
    assert ahead.now() == pytest.approx(seconds + micros / 1e6, abs=0.05)
    assert ahead.offset_from_host_s == pytest.approx(-8.0, abs=0.05)
    assert ahead.round_trip_s < 0.05


def test_a_clock_that_cannot_sync_keeps_its_last_offset_and_tries_again_later(tmp_path):
    from tests.support import RedisServer

    server = RedisServer(tmp_path)
    behind = ServiceClock(wall=lambda: time.time() - 10.0)
    behind.follow(redis.Redis(port=server.port, socket_connect_timeout=0.5))
    server.stop()
    assert not behind.sync()  # Redis away
    assert behind.now() == pytest.approx(time.time(), abs=0.5)  # still the service's clock, not the host's
    assert behind._next_sync_at > time.monotonic()  # and it does not try on every call


def test_a_deadline_is_judged_on_the_service_clock():
    assert deadline_at(100.0, 6000) == 106.0
    assert not is_past(106.0, now=106.0) and is_past(106.0, now=106.001)
    assert seconds_left(106.0, now=100.5) == 5.5


def test_a_deadline_past_the_last_iso_date_is_shown_as_that_date_not_a_failed_read():
    from contract.documents import job_document

    document = job_document({"id": "j" * 32, "status": "running", "received_at": 0.0, "deadline_at": 1e12})
    assert document["deadline_at"] == "9999-12-31T23:59:59.000Z"
    assert document["created_at"] == "1970-01-01T00:00:00.000Z"
    for odd in (-1e12, float("nan")):
        assert (
            job_document({"id": "j" * 32, "status": "queued", "received_at": odd})["created_at"]
            == "1970-01-01T00:00:00.000Z"
        )


def test_the_lua_judgement_is_the_same_as_pythons(redis_client: redis.Redis):
    script = redis_client.register_script(
        DEADLINE_PASSED_LUA + "return deadline_passed(tonumber(ARGV[1]), ARGV[2]) and 1 or 0"
    )
    for deadline, now in ((106.0, 106.0), (106.0, 106.001), (106.0, 105.0)):
        assert bool(script(args=[deadline, now])) == is_past(deadline, now)
    assert script(args=["", 1e12]) == 0  # no deadline: never past


def test_a_job_id_tells_when_it_was_issued_and_a_missing_record_within_its_ttl_was_lost():
    job_id = new_job_id()
    assert len(job_id) == 32 and __import__("re").fullmatch(JOB_ID_PATTERN, job_id)
    assert issued_at(job_id) == pytest.approx(clock_module.now(), abs=1.0)
    assert lost_at(job_id, ttl_s=3600) == pytest.approx(issued_at(job_id))
    assert lost_at(job_id, ttl_s=3600, now=issued_at(job_id) + 3600) is None  # its record may have expired
    assert lost_at(job_id, ttl_s=30) is None  # a TTL too short to tell
    assert lost_at("f" * 32, ttl_s=3600) is None  # from the far future: not one of ours
    assert lost_at("not-an-id", ttl_s=3600) is None
    assert new_job_id() != new_job_id()


def test_no_lua_step_reads_redis_time_the_service_clock_is_passed_in(redis_client: redis.Redis, monkeypatch):
    """A step that compares a moment written from the service's clock with Redis's own TIME mixes two clocks
    (they differ by the writer's sync error, and after a failover by the new primary's host clock until the next
    sync): every Lua step takes `now` as an argument instead (issue 63, item 3). Then a redelivery judged at a
    moment the caller's clock gives, not Redis's."""
    import ast
    from pathlib import Path

    reading_time = []
    root = Path(__file__).resolve().parents[1]
    for path in sorted(
        path for package in ("app", "contract", "tasks", "gpu_worker") for path in (root / package).rglob("*.py")
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "redis.call('TIME')" in node.value:
                reading_time.append(str(path))
    library = (root / "contract" / "library").glob("*.lua")
    reading_time += [str(path) for path in library if "'TIME'" in path.read_text()]
    assert not reading_time, reading_time

    from contract.jobs.ending import IN_FLIGHT_STALE_S, REDELIVER_IN_FLIGHT, REDELIVER_QUEUED, JobEnding
    from contract.redis.keys import Keys

    keys = Keys("one-clock-redelivery")
    ending = JobEnding(redis_client, keys, ttl_s=60)
    job = "0" * 32
    written_at = time.time() + 3 * IN_FLIGHT_STALE_S  # a writer's clock far from Redis's
    redis_client.hset(
        keys.job(job),
        mapping={
            "status": "succeeded",
            "callback_url": "http://127.0.0.1:9/",
            "finished_at": written_at,
            "callback": '{"status":"pending","attempts":0}',
        },
    )
    # the service's clock as the caller reads it: a second after the write, then past the stale bound
    monkeypatch.setattr("contract.jobs.ending.service_now", lambda: written_at + 1.0)
    assert ending.redeliver_callback(job) == REDELIVER_IN_FLIGHT  # pending for a second: on its way
    monkeypatch.setattr("contract.jobs.ending.service_now", lambda: written_at + IN_FLIGHT_STALE_S + 1.0)
    assert ending.redeliver_callback(job) == REDELIVER_QUEUED  # pending for longer than it may be: lost
