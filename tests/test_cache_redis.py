"""The result cache on a Redis of its own (`cache.redis_url`, contract.cache.cache_plane): its entries there without
books (Redis's maxmemory and TTL evict), a hit's job on the control plane, one cache for every cell, and a dead or full
cache Redis a miss, never an error or a stall.
Against real Redis servers (a cache Redis killed with SIGKILL and started again), and a real stack over HTTP."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from bench.stack.processes import RedisServer
from contract.admission import budget
from contract.cache import CacheLimits
from contract.cache.cache_plane import CachePlane, cache_plane, redis_address
from contract.jobs.hits import RESULT_REF, HitLimited, HitLimits
from contract.jobs.intake import JobIntake
from contract.jobs.record import SUCCEEDED
from contract.redis.keys import Keys
from contract.settings import CacheSettings, Settings
from contract.settings.models import ModelSpec
from tests.conftest import Stack, content_box_spec, start_stack, stop_stack
from tests.support import jpeg, wait_until

SPEC = ModelSpec(name="box", version="1", labels=("content",))
DOCUMENT = '{"detections":[],"image":{"width":8,"height":8}}'
REQUEST = budget.AdmissionRequest(
    "box:1", 700, max_backlog=10, max_model_bytes=10**6, max_all_bytes=10**6, max_tenant_backlog=10
)


def _fields() -> dict:
    return {"model": "box:1", "received_at": time.time(), "deadline_at": time.time() + 30, "bytes": 700}


@pytest.fixture()
def cache_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, extra_args=("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"))
    yield server
    if server.process.poll() is None:
        server.stop()


def _plane(server: RedisServer, retry_s: float = 0.3) -> CachePlane:
    client = redis.Redis.from_url(server.url, socket_timeout=0.1, socket_connect_timeout=0.1)
    return CachePlane(client, redis_address(server.url), retry_s)


def _remember(plane: CachePlane, keys: Keys, digest: str) -> bool:
    """As a GPU worker stores an entry after its batch write: True when written (or kept: NX)."""
    return plane.remember([(keys.cache_entry(digest), DOCUMENT)], 60, 10**6) == 0


def test_an_entry_stored_by_one_cell_is_a_hit_in_another_whose_record_and_answer_stay_there(redis_server, cache_server):
    """Two cells (two control planes: two databases here) and one cache Redis: the entry a GPU worker of cell a
    stored there answers cell b's lookup, and b's hit job, its shared answer and its books in b."""
    cell_a = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/11")
    cell_b = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/12")
    for client in (cell_a, cell_b):
        client.flushdb()
    keys, plane = Keys("cache-apart"), _plane(cache_server)
    limits = CacheLimits(keys.cache_prefix, 10**6, 60, apart=True)
    assert limits.finish_names()[1] == -1  # the control plane's step stores nothing, returns what to store
    assert _remember(plane, keys, "known")  # as cell a's worker does
    there = redis.Redis.from_url(cache_server.url)
    assert there.get(keys.cache_entry("known")) == DOCUMENT.encode() and 0 < there.ttl(keys.cache_entry("known")) <= 60
    assert not there.exists(keys.cache_lru, keys.cache_sizes, keys.cache_bytes)  # no books: Redis's own LRU evicts
    b = JobIntake(cell_b, keys, ttl_s=60, cache_plane=plane)
    hit = b.answer_or_admit("h", _fields(), "known", 60, {"total": 0.2}, REQUEST)
    assert hit == (SUCCEEDED, DOCUMENT)
    assert b.load("h")["status"] == SUCCEEDED and b.load("h")["result"] == json.loads(DOCUMENT)
    assert cell_b.get(keys.hit_result("known")) == DOCUMENT.encode()  # the answer the record refers to, in b
    assert not cell_b.exists(keys.cache_entry("known")) and not cell_a.keys("*")  # no entry on a control plane
    assert there.hgetall(keys.cache_stats) == {b"box:1:hits": b"1"}  # the hit's books where the entry is
    missed = b.answer_or_admit("m", _fields(), "unknown", 60, {"total": 0.2}, REQUEST)
    assert missed.verdict == budget.ADMITTED and b.flush_counts() == 1
    assert there.hget(keys.cache_stats, "box:1:misses") == b"1"


def test_hits_from_the_cache_redis_are_still_bounded_per_key_and_share_one_answer(redis_server, cache_server):
    """Issue 70 finding 1 with the cache apart: each hit's record refers to the one shared answer in its cell, and
    the key's hits take their bytes from its bucket there: past it, HitLimited and nothing stored."""
    keys, plane = Keys("cache-bucket"), _plane(cache_server)
    control = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/15")
    control.flushdb()
    store = JobIntake(control, keys, ttl_s=60, cache_plane=plane, hits=HitLimits(1500, 60, 60))
    assert _remember(plane, keys, "known")
    answers = [store.answer_or_admit(f"h{i}", _fields(), "known", 60, {}, REQUEST, "key-a") for i in range(6)]
    assert answers[0] == (SUCCEEDED, DOCUMENT)
    limited = [i for i, answer in enumerate(answers) if isinstance(answer, HitLimited)]
    assert limited and all(store.load(f"h{i}") is None for i in limited)  # refused: nothing stored
    assert store.load("h0")[RESULT_REF] == "known" and control.get(keys.hit_result("known")) == DOCUMENT.encode()
    other = store.answer_or_admit("b0", _fields(), "known", 60, {}, REQUEST, "key-b")
    assert other == (SUCCEEDED, DOCUMENT)  # another key's bucket is its own


def test_a_dead_cache_redis_is_a_miss_at_once_and_is_tried_again_after_retry_s(redis_server, cache_server):
    keys, plane = Keys("cache-dead"), _plane(cache_server, retry_s=0.5)
    control = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/13")
    control.flushdb()
    store = JobIntake(control, keys, ttl_s=60, cache_plane=plane)
    assert _remember(plane, keys, "known")
    assert store.answer_or_admit("h1", _fields(), "known", 60, {}, REQUEST).status == SUCCEEDED
    cache_server.process.kill()  # SIGKILL: no goodbye on its connections
    cache_server.process.wait(10)
    started = time.monotonic()
    verdict = store.answer_or_admit("m1", _fields(), "known", 60, {}, REQUEST)
    assert verdict.verdict == budget.ADMITTED and not plane.up  # a miss, admitted here; the plane marked down
    again = time.monotonic()
    assert store.answer_or_admit("m2", _fields(), "known", 60, {}, REQUEST).verdict == budget.ADMITTED
    assert time.monotonic() - again < 0.05 <= 0.5  # marked down: not even tried
    assert again - started < 1.0  # bounded by cache.timeout_ms, not by Redis's own patience
    assert not _remember(plane, keys, "other")  # the write dropped
    assert store.flush_counts() == 0 and store.misses._counts["box:1"] == 2  # kept for a later tick
    cache_server.start()  # back, empty (no persistence): plain commands, nothing to load there
    wait_until(lambda: plane.up, 5, what="the retry period to pass")
    assert _remember(plane, keys, "known")
    assert store.answer_or_admit("h2", _fields(), "known", 60, {}, REQUEST).status == SUCCEEDED


def test_a_stalled_cache_redis_is_a_miss_within_the_timeout_not_a_stall(redis_server, cache_server):
    """SIGSTOP: the cache Redis accepts connections but never answers (a stalled or swapping server)."""
    keys, plane = Keys("cache-stalled"), _plane(cache_server)
    control = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/13")
    store = JobIntake(control, keys, ttl_s=60, cache_plane=plane)
    assert _remember(plane, keys, "known")
    cache_server.process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert store.answer_or_admit("s1", _fields(), "known", 60, {}, REQUEST).verdict == budget.ADMITTED
        assert not _remember(plane, keys, "other")
        assert time.monotonic() - started < 1.0  # the 100 ms timeout once, then the circuit: no stall
    finally:
        cache_server.process.send_signal(signal.SIGCONT)
    wait_until(lambda: plane.up, 5, what="the retry period to pass")
    assert store.answer_or_admit("s2", _fields(), "known", 60, {}, REQUEST).status == SUCCEEDED


def test_without_a_cache_redis_url_there_is_no_cache_plane():
    settings = Settings(model=SPEC, models=(SPEC,))
    assert cache_plane(settings) is None
    assert CacheLimits.of(settings, Keys("x")).finish_names()[1] == settings.cache.max_bytes  # stored in the step
    hidden = dataclasses.replace(settings, cache=CacheSettings(redis_url="redis://:a-long-secret@cache-host:6379/0"))
    assert redis_address(hidden.cache.redis_url) == "redis://cache-host:6379/0"
    assert CacheLimits.of(hidden, Keys("x")).finish_names()[1] == -1  # the step returns them instead
    with pytest.raises(ValueError, match="cache.redis_url"):
        CacheSettings(redis_url="cache-host:6379")


# --- a stack whose cache is on its own Redis -------------------------------------------------------------------


@pytest.fixture(scope="module")
def apart_stack(redis_server, tmp_path_factory) -> Iterator[tuple[Stack, RedisServer]]:
    workdir = tmp_path_factory.mktemp("cache-apart")
    cache = RedisServer(workdir, extra_args=("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"))
    url = redis_server.url.rsplit("/", 1)[0] + "/14"
    redis.Redis.from_url(url).flushdb()
    model = content_box_spec(workdir, 64)
    settings = {"enabled": True, "redis_url": cache.url, "timeout_ms": 100, "retry_s": 0.5}
    stack = start_stack(url, workdir, {**model, "name": "box", "version": "1"}, "apart", {"cache": settings})
    yield stack, cache
    stop_stack(stack)
    if cache.process.poll() is None:
        cache.stop()


def test_a_repeat_hits_with_the_entry_on_the_cache_redis_and_none_on_the_control_plane(apart_stack):
    stack, cache = apart_stack
    image = jpeg(96, 80, seed=201)
    first = stack.wait_terminal(stack.submit_ok(image))
    assert first["status"] == "succeeded" and first["cache"] == "miss"
    digest = stack.redis.hget(stack.keys.job(first["id"]), "cache_key").decode()
    there = redis.Redis.from_url(cache.url)
    wait_until(lambda: there.exists(stack.keys.cache_entry(digest)), 10, what="the entry on the cache Redis")
    assert not stack.redis.exists(stack.keys.cache_entry(digest), stack.keys.cache_lru, stack.keys.cache_bytes)
    hit = stack.submit(image).json()
    assert hit["cache"] == "hit" and hit["status"] == "succeeded" and hit["result"] == first["result"]
    stats = stack.session.get(stack.url("/v1/stats"), timeout=10).json()["cache"]
    assert stats["redis"] == redis_address(cache.url) and stats["available"] and stats["entries"] >= 1
    assert stats["maxmemory"] == 64 * 2**20 and stats["bytes"] > 0  # its INFO: no books kept there


def test_the_cache_redis_killed_under_load_costs_misses_only_and_hits_come_back(apart_stack):
    """SIGKILL of the cache Redis while jobs arrive: every job still succeeds (its lookup a miss, its entry's
    write dropped); once it is back (empty), a repeated image is a hit again."""
    stack, cache = apart_stack
    images = [jpeg(64, 48, seed=300 + i) for i in range(24)]

    def one(image: bytes) -> dict:
        return stack.wait_terminal(stack.submit_ok(image), timeout_s=120)

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(one, image) for image in images[:16]]
        wait_until(lambda: sum(f.done() for f in running) >= 4, 120, what="the first jobs done")
        cache.process.kill()
        cache.process.wait(10)
        killed_at = time.monotonic()
        in_flight = sum(not f.done() for f in running)
        running += [pool.submit(one, image) for image in images[16:]]  # submitted with the cache Redis dead
        ended = [f.result() for f in running]
    assert in_flight > 0  # the kill came under load: jobs were in flight
    assert [job["status"] for job in ended] == ["succeeded"] * len(images)
    during = stack.wait_terminal(stack.submit_ok(images[0]))  # computed before, its entry unreachable now
    assert during["status"] == "succeeded" and during["cache"] == "miss"
    assert stack.session.get(stack.url("/v1/stats"), timeout=10).json()["cache"]["available"] is False
    assert time.monotonic() - killed_at < 60
    cache.start()
    again = jpeg(64, 48, seed=399)

    def hits_again() -> bool:
        done = stack.wait_terminal(stack.submit_ok(again))
        assert done["status"] == "succeeded"
        return stack.submit(again).json().get("cache") == "hit"

    wait_until(hits_again, 30, interval_s=0.5, what="a hit after the cache Redis came back")


# --- no books: Redis's own maxmemory evicts, INFO tells the size -------------------------------------------------


def _server(tmp_path, policy: str, maxmemory: str = "4mb") -> RedisServer:
    return RedisServer(tmp_path, extra_args=("--maxmemory", maxmemory, "--maxmemory-policy", policy))


def test_an_evicting_cache_redis_keeps_taking_entries_past_its_maxmemory_and_drops_the_oldest(tmp_path):
    server = _server(tmp_path, "allkeys-lru")
    try:
        plane, keys, document = _plane(server), Keys("cache-evict"), "x" * 64_000
        for batch in range(25):  # 200 entries of 64 kB: over three times its 4 MB
            entries = [(keys.cache_entry(f"d{batch}-{i}"), document) for i in range(8)]
            assert plane.remember(entries, 60, 10**6) == 0  # every write taken
        size = plane.size()
        assert size is not None and 0 < size.entries < 200 and size.used_bytes <= 4 * 2**20
        assert plane.lookup(keys.cache_entry("d24-7")) == document.encode()  # the newest kept
        # Redis's LRU is sampled, not exact: any one old entry may survive, but the older half loses more
        kept = [sum(plane.lookup(keys.cache_entry(f"d{b}-{i}")) is not None for i in range(8)) for b in range(25)]
        assert sum(kept[:12]) < sum(kept[13:]) and plane.up
    finally:
        server.stop()


def test_a_full_cache_redis_without_eviction_costs_misses_not_errors_and_is_warned_about_once(
    redis_server, tmp_path, caplog
):
    """noeviction (an operator's own Redis): warned about at the start, once; full, it refuses the writes (OOM),
    which are dropped; its lookups still answer (a stored entry hits, a refused one misses), no job fails."""
    server = _server(tmp_path, "noeviction")
    try:
        settings = Settings(model=SPEC, models=(SPEC,), cache=CacheSettings(redis_url=server.url, timeout_ms=500))
        with caplog.at_level("WARNING", logger="contract.cache.cache_plane"):
            plane = cache_plane(settings)
            assert plane is not None
            for _ in range(3):
                plane._size_at -= 2  # past the once-a-second reading: read again, not warned again
                assert plane.size() is not None
        warned = [r for r in caplog.records if "maxmemory-policy noeviction" in r.getMessage()]
        assert len(warned) == 1
        keys, document = Keys("cache-full"), "y" * 64_000
        assert plane.remember([(keys.cache_entry("kept"), DOCUMENT)], 60, 10**6) == 0
        refused = 0
        for batch in range(25):
            refused += plane.remember([(keys.cache_entry(f"f{batch}-{i}"), document) for i in range(8)], 60, 10**6) or 0
        assert refused > 0 and plane.up  # full: writes refused, the plane not marked down
        control = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/10")
        control.flushdb()
        store = JobIntake(control, keys, ttl_s=60, cache_plane=plane)
        assert store.answer_or_admit("h", _fields(), "kept", 60, {}, REQUEST) == (SUCCEEDED, DOCUMENT)
        assert store.answer_or_admit("m", _fields(), "f24-7", 60, {}, REQUEST).verdict == budget.ADMITTED
    finally:
        server.stop()


def test_the_size_is_the_cache_redis_info_read_at_most_once_a_second(cache_server, caplog):
    now = [100.0]
    client = redis.Redis.from_url(cache_server.url, socket_timeout=0.5)
    plane = CachePlane(client, redis_address(cache_server.url), 0.3, clock=lambda: now[0])
    keys = Keys("cache-size")
    with caplog.at_level("WARNING", logger="contract.cache.cache_plane"):
        assert plane.remember([(keys.cache_entry(f"s{i}"), DOCUMENT) for i in range(3)], 60, 10**6) == 0
        client.hincrby(keys.cache_stats, "box:1:hits", 1)  # no TTL: not an entry
        first = plane.size()
        assert first is not None and first.entries == 3 and first.used_bytes > 0
        assert (first.maxmemory, first.policy) == (64 * 2**20, "allkeys-lru")
        assert plane.remember([(keys.cache_entry("s3"), DOCUMENT), ("too-big", "z" * 99)], 60, 98) == 0
        assert plane.size() == first  # within the second: not read again
        now[0] += 1.0
        second = plane.size()
        assert second is not None and second.entries == 4 and not client.exists("too-big")
    assert not caplog.records  # allkeys-lru with a maxmemory: nothing to warn about
