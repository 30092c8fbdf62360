"""The result cache (contract.cache): a repeated image is answered from the first one's result, within a byte
budget, per API key, only for answers that stood. Against real Redis, and a real stack over HTTP."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import requests

from app import create_app
from app.auth import hash_key
from bench.stack.processes import free_port
from contract.admission import budget
from contract.cache import ENTRY_OVERHEAD, CacheLimits, MissCounts, ResultCache, effective_options
from contract.jobs.ending import JobEnding
from contract.jobs.intake import JobIntake
from contract.jobs.record import CANCELLED, EXPIRED, FAILED, RUNNING, SUCCEEDED, JobStore
from contract.redis.keys import Keys
from contract.settings import CacheSettings, Settings
from contract.settings.models import ModelSpec
from tests.conftest import Stack, content_box_spec, start_stack, stop_stack
from tests.support import ApiServer, jpeg, wait_until

MAX_BYTES = 4000  # about ten entries of the known-answer detector's one-box document

SPEC = ModelSpec(name="box", version="1", labels=("content",))


# --- the digest and the step that stores entries (real Redis, no stack) --------------------------------------


def test_the_digest_covers_the_image_the_model_the_options_as_applied_and_the_key():
    settings = Settings(model=SPEC, models=(SPEC, dataclasses.replace(SPEC, version="2")))
    cache = ResultCache(redis.Redis(), Keys("unit"), settings)  # no command is sent here
    image, other = jpeg(32, 32, seed=1), jpeg(32, 32, seed=2)
    base = cache.digest(image, SPEC, {}, "team-a")
    assert cache.digest(image, SPEC, {"conf": SPEC.conf, "max_det": SPEC.max_det}, "team-a") == base  # defaults
    assert (
        len(
            {
                base,
                cache.digest(other, SPEC, {}, "team-a"),
                cache.digest(image, SPEC, {"conf": 0.3}, "team-a"),
                cache.digest(image, SPEC, {}, "team-b"),
                cache.digest(image, settings.models[1], {}, "team-a"),
                cache.digest(image, dataclasses.replace(SPEC, iou=0.5), {}, "team-a"),
            }
        )
        == 6
    )
    shared = ResultCache(redis.Redis(), Keys("unit"), dataclasses.replace(settings, cache=CacheSettings(shared=True)))
    assert shared.digest(image, SPEC, {}, "team-a") == shared.digest(image, SPEC, {}, "team-b")
    assert effective_options(SPEC, {"iou": 0.6}) == (SPEC.conf, 0.6, SPEC.max_det)


def _job(store: JobStore, job_id: str, digest: str, deadline_in_s: float = 60.0) -> None:
    store.redis.hset(
        store.keys.job(job_id),
        mapping={"id": job_id, "status": RUNNING, "cache_key": digest, "deadline_at": time.time() + deadline_in_s},
    )


def test_only_an_answer_that_stood_is_stored_and_the_budget_evicts_the_least_recently_used(redis_client):
    keys = Keys("cache-unit")
    document = '{"detections":[],"image":{"width":8,"height":8}}'
    budget = 3 * (ENTRY_OVERHEAD + len(document))  # three entries
    store = JobEnding(redis_client, keys, ttl_s=60, cache=CacheLimits(keys.cache_prefix, budget))
    for job_id, status, deadline_in_s in (("f", FAILED, 60), ("c", CANCELLED, 60), ("l", SUCCEEDED, -1)):
        _job(store, job_id, "d-" + job_id, deadline_in_s)
        store.finish(job_id, status, {"result": document} if status == SUCCEEDED else {"error": {"code": "x"}})
        assert not redis_client.exists(keys.cache_entry("d-" + job_id)), status  # "l" ended late: expired
    assert store.load("l")["status"] == EXPIRED
    for i in range(5):
        _job(store, f"s{i}", f"d{i}")
        store.finish(f"s{i}", SUCCEEDED, {"result": document})
        assert int(redis_client.get(keys.cache_bytes)) <= budget
    assert [d.decode() for d in redis_client.zrange(keys.cache_lru, 0, -1)] == ["d2", "d3", "d4"]
    assert not redis_client.exists(keys.cache_entry("d0"))
    assert redis_client.get(keys.cache_entry("d4")) == document.encode()
    assert sum(int(v) for v in redis_client.hvals(keys.cache_sizes)) == int(redis_client.get(keys.cache_bytes))
    _job(store, "again", "d4")  # the same digest answered again: the first stays
    store.finish("again", SUCCEEDED, {"result": '{"detections":[1]}'})
    assert redis_client.get(keys.cache_entry("d4")) == document.encode()
    assert int(redis_client.get(keys.cache_bytes)) == budget


def test_an_expired_entrys_bookkeeping_goes_with_the_next_entries_stored_under_budget(redis_client):
    """An entry's key expires by its TTL; its LRU member, size field and charge used to stay until the budget
    filled (hours at the story's rate: Redis grew past what the TTLs predict). Each entry stored now takes up to
    STALE_PER_ENTRY of the expired ones with it."""
    keys = Keys("cache-stale")
    document = '{"detections":[],"image":{"width":8,"height":8}}'
    store = JobEnding(redis_client, keys, ttl_s=60, cache=CacheLimits(keys.cache_prefix, 10**6, ttl_s=60))
    for i in range(3):
        _job(store, f"old{i}", f"old{i}")
        store.finish(f"old{i}", SUCCEEDED, {"result": document})
    # Their TTL ran out: the keys are gone, and their last use is more than a TTL ago.
    redis_client.delete(*[keys.cache_entry(f"old{i}") for i in range(3)])
    redis_client.zadd(keys.cache_lru, {f"old{i}": time.time() - 61 - i for i in range(3)})
    _job(store, "new", "new")
    store.finish("new", SUCCEEDED, {"result": document})
    left = {d.decode() for d in redis_client.zrange(keys.cache_lru, 0, -1)}
    assert left == {"new", "old0"}  # the two oldest went, within budget
    assert {f.decode() for f in redis_client.hkeys(keys.cache_sizes)} == left
    assert int(redis_client.get(keys.cache_bytes)) == 2 * (ENTRY_OVERHEAD + len(document))
    _job(store, "next", "next")
    store.finish("next", SUCCEEDED, {"result": document})
    assert {d.decode() for d in redis_client.zrange(keys.cache_lru, 0, -1)} == {"new", "next"}
    assert int(redis_client.get(keys.cache_bytes)) == 2 * (ENTRY_OVERHEAD + len(document))


def test_the_lookup_admits_a_miss_in_the_same_step_and_a_hit_needs_no_admission(redis_client):
    keys = Keys("cache-admit")
    store = JobIntake(redis_client, keys, ttl_s=60)
    document = '{"detections":[],"image":{"width":8,"height":8}}'
    redis_client.set(keys.cache_entry("known"), document)
    redis_client.zadd(keys.cache_lru, {"known": 1.0})
    full = budget.AdmissionRequest(
        "box:1", 700, max_backlog=0, max_model_bytes=10**6, max_all_bytes=10**6, max_tenant_backlog=10
    )
    fields = {"model": "box:1", "received_at": time.time(), "deadline_at": time.time() + 30, "bytes": 700}
    timings = {"receive": 0.1, "total": 0.2}
    assert store.answer_or_admit("h", fields, "known", 60, timings, full) == (SUCCEEDED, document)  # served
    # over a full backlog
    assert store.load("h")["status"] == SUCCEEDED and store.load("h")["result"] == json.loads(document)
    refused = store.answer_or_admit("m", fields, "unknown", 60, timings, full)
    assert refused[:5] == (budget.OVER_BACKLOG, 0, 0, 0, 0) and store.load("m") is None
    assert budget.WaitingBytes(redis_client, keys).waiting() == {budget.ALL: 0}  # nothing reserved either way
    admitted = store.answer_or_admit("m", fields, "unknown", 60, timings, full._replace(max_backlog=10))
    assert admitted.verdict == budget.ADMITTED and store.load("m") is None  # the API stores it next
    assert budget.WaitingBytes(redis_client, keys).waiting() == {"box:1": 700, budget.ALL: 700}
    assert redis_client.hgetall(keys.cache_stats) == {b"box:1:hits": b"1"}  # misses: counted by the API first
    assert store.flush_counts() == 2 and store.flush_counts() == 0  # then added once, by its sweeper's tick
    counts = redis_client.hgetall(keys.cache_stats)
    assert counts == {b"box:1:hits": b"1", b"box:1:misses": b"2"}


def test_a_hit_past_its_deadline_is_expired_without_the_result_never_both(redis_client):
    """deadline_ms=1 on a repeated image: the lookup came after the deadline. The 202 said succeeded and a read
    said expired, with the result, before: one answer now, the one every later read gives."""
    keys = Keys("cache-late")
    store = JobIntake(redis_client, keys, ttl_s=60)
    document = '{"detections":[],"image":{"width":8,"height":8}}'
    redis_client.set(keys.cache_entry("known"), document)
    request = budget.AdmissionRequest(
        "box:1", 700, max_backlog=10, max_model_bytes=10**6, max_all_bytes=10**6, max_tenant_backlog=10
    )
    received = time.time() - 0.01
    late = {"model": "box:1", "received_at": received, "deadline_at": received + 0.001, "bytes": 700}
    status = store.answer_or_admit("late", late, "known", 60, {"total": 10.0}, request).status
    record = store.load("late")
    assert status == record["status"] == EXPIRED
    assert record.get("result") is None and record["error"]["code"] == "deadline"
    in_time = {**late, "deadline_at": time.time() + 30}
    assert store.answer_or_admit("on-time", in_time, "known", 60, {"total": 1.0}, request).status == SUCCEEDED
    assert store.load("on-time")["result"] == json.loads(document)


def test_the_gpu_worker_exports_the_caches_entries_bytes_and_budget(redis_client):
    from prometheus_client import REGISTRY

    from contract.workers.heartbeat import Heartbeat
    from gpu_worker.heartbeat import Liveness

    keys = Keys("cache-gauges")
    settings = Settings(model=SPEC, models=(SPEC,), cache=CacheSettings(max_bytes=5000))
    store = JobEnding(redis_client, keys, ttl_s=60, cache=CacheLimits.of(settings, keys))
    for i in range(3):
        _job(store, f"g{i}", f"gd{i}")
        store.finish(f"g{i}", SUCCEEDED, {"result": '{"detections":[]}'})
    liveness = Liveness(
        settings, redis_client, keys, "w", lambda: Heartbeat.__new__(Heartbeat), time.monotonic, lambda: 0.0
    )
    liveness.export_cache_size()
    assert REGISTRY.get_sample_value("imgserve_cache_entries") == 3
    assert REGISTRY.get_sample_value("imgserve_cache_bytes") == 3 * (ENTRY_OVERHEAD + len('{"detections":[]}'))
    assert REGISTRY.get_sample_value("imgserve_cache_max_bytes") == 5000


# --- a stack with the cache on ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_stack(redis_server, tmp_path_factory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("cache")
    url = redis_server.url.rsplit("/", 1)[0] + "/10"
    redis.Redis.from_url(url).flushdb()
    base = content_box_spec(workdir, 64)
    models = [{**base, "name": "box", "version": "1"}, {**base, "name": "box", "version": "2"}]
    stack = start_stack(
        url,
        workdir,
        None,
        "cache",
        {"models": models, "routing": {"routes": {"box": "1"}}, "cache": {"enabled": True, "max_bytes": MAX_BYTES}},
    )
    yield stack
    stop_stack(stack)


def test_a_repeated_image_is_answered_at_once_from_the_first_ones_result(cache_stack):
    image = jpeg(96, 80, seed=101)
    first = cache_stack.wait_terminal(cache_stack.submit_ok(image))
    assert first["status"] == "succeeded" and first["cache"] == "miss" and first["batch"]
    accepted = cache_stack.submit(image)
    assert accepted.status_code == 202 and accepted.json()["status"] == "succeeded"
    assert accepted.json()["cache"] == "hit" and accepted.json()["result"] == first["result"]  # no poll needed
    assert set(accepted.json()["timings_ms"]) == {"receive", "total"}
    poll = cache_stack.session.get(cache_stack.url(f"/v1/jobs/{accepted.json()['id']}"), timeout=10)
    assert float(poll.headers["Server-Timing"].removeprefix("app;dur=")) < 1000  # the API's own time, in ms
    again = cache_stack.job(accepted.json()["id"])  # over already: no wait
    assert again["status"] == "succeeded" and again["cache"] == "hit" and again["result"] == first["result"]
    assert again["batch"] is None and set(again["timings_ms"]) == {"receive", "total"}
    default_conf = cache_stack.settings.models[0].conf
    assert cache_stack.submit(image, conf=default_conf).json()["cache"] == "hit"  # the same threshold, as applied
    assert cache_stack.submit(image, conf=0.3).json()["cache"] == "miss"  # another answer
    assert cache_stack.submit(image, model="box:2").json()["cache"] == "miss"  # another version
    opted_out = cache_stack.submit(image, cache="false").json()
    assert opted_out["status"] == "queued" and "cache" not in opted_out

    def cache_stats() -> dict:
        return cache_stack.session.get(cache_stack.url("/v1/stats"), timeout=10).json()["cache"]

    # the misses reach the shared counters at the API's next sweeper tick (once a second: contract.cache.MissCounts)
    stats = wait_until(lambda: (found := cache_stats())["models"]["box:1"]["misses"] and found, 10, what="misses")
    assert stats["models"]["box:1"]["hits"] >= 2 and 0 < stats["models"]["box:1"]["hit_rate"] < 1
    assert 0 < stats["bytes"] <= MAX_BYTES and stats["entries"] >= 1
    metrics = cache_stack.session.get(cache_stack.url("/metrics"), timeout=10).text
    # the cell the lookup was in: `default`, the one cell of a deployment without cells (docs/cells.md)
    assert 'imgserve_api_cache_lookups_total{cell="default",model="box",result="hit",version="1"}' in metrics


def test_a_hit_past_a_tiny_deadline_says_expired_at_once_and_on_every_read(cache_stack):
    """The newcomer's finding: deadline_ms=1 on a repeated image got a 202 `succeeded` with the result, and a
    read at once said `expired`, still with the result. Whatever the answer is, the 202 and the reads agree."""
    image = jpeg(96, 80, seed=102)
    assert cache_stack.wait_terminal(cache_stack.submit_ok(image))["status"] == "succeeded"
    for _ in range(2):
        accepted = cache_stack.submit(image, deadline_ms=1).json()
        read = cache_stack.job(accepted["id"])
        assert accepted["cache"] == "hit" and accepted["status"] == read["status"]
        assert read["status"] in ("succeeded", "expired")
        if read["status"] == "expired":
            assert accepted.get("result") is None and read["result"] is None and read["error"]["code"] == "deadline"
        else:
            assert accepted["result"] == read["result"] is not None
    answered = cache_stack.session.post(
        cache_stack.url("/v1/jobs"), params={"wait": 5}, data=image, headers={"Content-Type": "image/jpeg"}, timeout=30
    )
    assert answered.status_code == 200 and answered.json()["cache"] == "hit"  # one call, from the cache too
    assert answered.json()["status"] == "succeeded" and answered.json()["result"]["detections"] is not None
    assert answered.headers["Content-Location"] == f"/v1/jobs/{answered.json()['id']}"


def test_over_a_full_backlog_a_miss_is_refused_and_a_hit_still_answered(cache_stack):
    """Over HTTP, an API of its own namespace whose jobs nobody takes: one job fills its backlog."""
    settings = dataclasses.replace(
        cache_stack.settings,
        namespace="cache-full",
        backpressure=dataclasses.replace(cache_stack.settings.backpressure, max_backlog=1),
    )
    server = ApiServer(create_app(settings))
    try:

        def submit(image: bytes) -> requests.Response:
            return requests.post(
                server.url + "/v1/jobs", data=image, timeout=30, headers={"Content-Type": "image/jpeg"}
            )

        waiting = submit(jpeg(64, 64, seed=111))
        assert waiting.status_code == 202 and waiting.json()["status"] == "queued"
        refused = submit(jpeg(64, 64, seed=112))
        assert refused.status_code == 429 and refused.headers["Content-Type"] == "application/problem+json"
        known = jpeg(64, 64, seed=113)
        spec = settings.models[0]
        digest = ResultCache(cache_stack.redis, Keys("cache-full"), settings).digest(known, spec, {}, "")
        answer = {"detections": [], "image": {"width": 64, "height": 64}, "model": {"name": "box", "version": "1"}}
        cache_stack.redis.set(Keys("cache-full").cache_entry(digest), json.dumps(answer))
        hit = submit(known)
        assert hit.status_code == 202, hit.text
        assert hit.json()["cache"] == "hit" and hit.json()["result"] == answer
    finally:
        server.stop()


def test_a_hit_fires_its_callback_like_any_job(cache_stack):
    from tests.test_callbacks import Receiver

    image = jpeg(90, 70, seed=102)
    cache_stack.wait_terminal(cache_stack.submit_ok(image))
    receiver = Receiver()
    try:
        hit = cache_stack.submit(image, callback_url=receiver.url).json()
        assert hit["cache"] == "hit"
        wait_until(lambda: receiver.calls, 20, what="the hit's callback")
    finally:
        receiver.stop()
    delivered = json.loads(receiver.calls[0]["body"])
    assert delivered["id"] == hit["id"] and delivered["cache"] == "hit" and delivered["status"] == "succeeded"


KEYS = ({"id": "team-a", "sha256": hash_key("key-a")}, {"id": "team-b", "sha256": hash_key("key-b")})


def _keyed_api(stack: Stack, shared: bool) -> ApiServer:
    auth = dataclasses.replace(stack.settings.auth, api_keys=KEYS)
    cache = dataclasses.replace(stack.settings.cache, shared=shared)
    return ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth, cache=cache)))


def _submit(server: ApiServer, key: str, image: bytes, **params: str) -> dict:
    response = requests.post(
        server.url + "/v1/jobs",
        data=image,
        params=params,
        timeout=30,
        headers={"Content-Type": "image/jpeg", "Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 202, response.text
    return response.json()


def _wait(server: ApiServer, key: str, job_id: str) -> dict:
    return requests.get(
        f"{server.url}/v1/jobs/{job_id}", params={"wait": 20}, timeout=40, headers={"Authorization": f"Bearer {key}"}
    ).json()


def test_one_keys_entry_is_a_miss_for_another_unless_the_cache_is_shared(cache_stack):
    per_key, shared = _keyed_api(cache_stack, shared=False), _keyed_api(cache_stack, shared=True)
    try:
        image = jpeg(100, 60, seed=103)
        assert _wait(per_key, "key-a", _submit(per_key, "key-a", image)["id"])["status"] == "succeeded"
        assert _submit(per_key, "key-a", image)["cache"] == "hit"
        assert _submit(per_key, "key-b", image)["cache"] == "miss"  # team-b learns nothing of team-a's
        other = jpeg(100, 60, seed=104)
        assert _wait(shared, "key-a", _submit(shared, "key-a", other)["id"])["status"] == "succeeded"
        assert _submit(shared, "key-b", other)["cache"] == "hit"  # shared on purpose
    finally:
        per_key.stop()
        shared.stop()


def test_a_draining_or_removed_versions_entries_are_not_served(cache_stack):
    image = jpeg(80, 80, seed=105)
    assert cache_stack.wait_terminal(cache_stack.submit_ok(image, model="box:2"))["status"] == "succeeded"
    assert cache_stack.submit(image, model="box:2").json()["cache"] == "hit"
    settings = cache_stack.settings
    draining = dataclasses.replace(settings, routing=dataclasses.replace(settings.routing, draining=("box:2",)))
    removed = dataclasses.replace(settings, models=settings.models[:1])
    for changed in (draining, removed):
        server = ApiServer(create_app(changed))
        try:
            pinned = requests.post(
                server.url + "/v1/jobs",
                data=image,
                params={"model": "box:2"},
                timeout=30,
                headers={"Content-Type": "image/jpeg"},
            )
            assert pinned.status_code == 404
            by_name = requests.post(
                server.url + "/v1/jobs",
                data=image,
                params={"model": "box"},
                timeout=30,
                headers={"Content-Type": "image/jpeg"},
            )
            done = requests.get(f"{server.url}/v1/jobs/{by_name.json()['id']}", params={"wait": 20}, timeout=40).json()
            assert done["status"] == "succeeded" and done["result"]["model"]["version"] == "1"  # never box:2's
        finally:
            server.stop()


def test_a_failed_job_leaves_no_entry(cache_stack):
    corrupt = jpeg(320, 240, seed=106)[:300] + os.urandom(500)
    for _ in range(2):
        job_id = cache_stack.submit_ok(corrupt)
        done = cache_stack.wait_terminal(job_id)
        assert done["status"] == "failed" and done["cache"] == "miss"
        digest = cache_stack.redis.hget(cache_stack.keys.job(job_id), "cache_key").decode()
        assert not cache_stack.redis.exists(cache_stack.keys.cache_entry(digest))


def test_identical_requests_at_once_each_compute_and_leave_one_entry(cache_stack):
    """Each computes (no request waits on another's job, whose deadline, key or cancellation are its own);
    the first answer written is the entry, and both answers are the same."""
    image = jpeg(120, 90, seed=107)
    ids: list[str] = []
    # "At once" made certain: with no GPU worker neither job can end (and store an entry) before the other's
    # lookup, which two threads alone do not promise on a loaded machine.
    cache_stack.stop_gpu_worker()
    try:
        threads = [threading.Thread(target=lambda: ids.append(cache_stack.submit_ok(image))) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        cache_stack.start_gpu_worker()
    docs = [cache_stack.wait_terminal(job_id) for job_id in ids]
    assert [doc["cache"] for doc in docs] == ["miss", "miss"] and all(doc["batch"] for doc in docs)
    assert docs[0]["result"] == docs[1]["result"]
    digests = {cache_stack.redis.hget(cache_stack.keys.job(job_id), "cache_key") for job_id in ids}
    assert len(digests) == 1 and cache_stack.redis.exists(cache_stack.keys.cache_entry(digests.pop().decode()))
    assert cache_stack.submit(image).json()["cache"] == "hit"


def test_a_flood_of_unique_images_keeps_the_cache_within_its_budget_and_every_job(cache_stack):
    keys, client = cache_stack.keys, cache_stack.redis
    ids = []
    for i in range(40):
        ids.append(cache_stack.submit_ok(jpeg(64, 48, seed=1000 + i)))
        if i % 8 == 7:
            cache_stack.wait_terminal(ids[-1])
            assert int(client.get(keys.cache_bytes) or 0) <= MAX_BYTES
    docs = [cache_stack.wait_terminal(job_id) for job_id in ids]
    assert all(doc["status"] == "succeeded" for doc in docs)  # no job record gave way to the cache
    charged = int(client.get(keys.cache_bytes))
    assert charged <= MAX_BYTES and sum(int(v) for v in client.hvals(keys.cache_sizes)) == charged
    assert client.zcard(keys.cache_lru) < 40
    assert cache_stack.submit(jpeg(64, 48, seed=1039)).json()["cache"] == "hit"  # the newest stays
    assert cache_stack.submit(jpeg(64, 48, seed=1000)).json()["cache"] == "miss"  # the oldest went


def test_the_cli_says_cache_hit_for_an_answer_from_the_cache(cache_stack, tmp_path):
    """Issue 53: a cache hit showed "(0 ms)" with no word that it was one."""
    import subprocess
    import sys

    from tests.support import REPO_ROOT

    photo = tmp_path / "again.jpg"
    photo.write_bytes(jpeg(200, 150, seed=53))
    firsts = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "imgserve_client.cli", "--url", cache_stack.api.url, "submit", str(photo), "--wait"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        firsts.append(result.stdout.splitlines()[0])
    assert "cache hit" not in firsts[0] and "(cache hit, " in firsts[1], firsts


def test_misses_counted_while_redis_is_away_are_added_at_the_next_flush(redis_client):
    """The API counts misses itself and adds them once a second: a flush Redis refuses keeps them for the next."""
    keys = Keys("cache-misses")
    counts = MissCounts()
    for model in ("a:1", "a:1", "b:1"):
        counts.count(model)
    away = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
    with pytest.raises(redis.ConnectionError):
        counts.flush(away, keys.cache_stats)
    assert counts.flush(redis_client, keys.cache_stats) == 3 and counts.flush(redis_client, keys.cache_stats) == 0
    assert redis_client.hgetall(keys.cache_stats) == {b"a:1:misses": b"2", b"b:1:misses": b"1"}
