"""Hostile clients, round seven: result-cache hits fill the store. A hit passed no budget, yet stored a whole copy
of its answer in a new job record for an hour, and a callback that kept failing kept that record for half a day.
Now a hit's record refers to one shared answer (contract.jobs.hits), each key's hits take their bytes from a
bucket (a 429 past it), and no callback retry moves a record past `jobs.max_ttl_s`. Against real Redis servers
(one with a small maxmemory) and the real API over HTTP."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from app.auth import hash_key
from app.services import services as api_services
from bench.stack.processes import RedisServer
from contract.admission import budget
from contract.cache import ResultCache
from contract.jobs.hits import HitLimits
from contract.jobs.intake import JobIntake
from contract.jobs.record import SUCCEEDED
from contract.redis.keys import Keys
from contract.settings import CallbackSettings, JobSettings, Settings
from contract.settings.models import ModelSpec
from tasks.callbacks.delivery import CallbackSender
from tests.support import ApiServer, api_with_keys, jpeg, wait_until

SPEC = ModelSpec(name="box", version="1", labels=("content",))
MODEL = {"name": "box", "version": "1"}
ADMISSION = budget.AdmissionRequest("box:1", 700, max_backlog=10, max_model_bytes=10**9, max_all_bytes=10**9)


def busy_answer(detections: int) -> str:
    """An answer as the issue's busy photo gave it with conf=0&iou=1&max_det=1000: a box a detection."""
    box = {"box": [12.34, 56.78, 90.12, 345.67], "score": 0.1234, "class_id": 0, "label": "content"}
    document = {"detections": [box] * detections, "image": {"width": 1280, "height": 720}, "model": MODEL}
    return json.dumps(document, separators=(",", ":"))


def hit_fields(**more: object) -> dict:
    now = time.time()
    return {"model": "box:1", "received_at": now, "deadline_at": now + 60, "bytes": 700, "owner": "a", **more}


def test_a_hits_record_refers_to_one_shared_answer_not_a_copy_and_reads_it_back(redis_client):
    """Each hit stored its ~100 KB answer again (9,757 records against 173 KB of cache entries). Now one shared
    copy, whatever the hits, and a record of a KB or two that reads back the same answer, after the
    cache entry itself is gone too."""
    keys = Keys("hits-ref")
    store = JobIntake(redis_client, keys, ttl_s=60, hits=HitLimits(0, 60, 600))
    answer = busy_answer(1000)
    assert len(answer) > 80_000
    redis_client.set(keys.cache_entry("busy"), answer, ex=60)
    assert store.answer_or_admit("0" * 32, hit_fields(), "busy", 60, {"total": 1.0}, ADMISSION).status == SUCCEEDED
    before = redis_client.info("memory")["used_memory"]
    for i in range(1, 21):
        assert store.answer_or_admit(f"{i:032x}", hit_fields(), "busy", 60, {"total": 1.0}, ADMISSION)
    grown_per_hit = (redis_client.info("memory")["used_memory"] - before) / 20
    # was ~100 KB: the answer again (a record is a hash table: configs/redis.conf; ~2.4 KB a hit in all)
    assert grown_per_hit < 4_000, grown_per_hit
    assert redis_client.memory_usage(keys.job(f"{20:032x}"), samples=0) < 2_000
    assert not redis_client.hexists(keys.job(f"{20:032x}"), "result")
    assert 600 - 2 <= redis_client.ttl(keys.hit_result("busy")) <= 600  # as long as any record may live
    redis_client.delete(keys.cache_entry("busy"))  # evicted from the cache: the jobs still read their answer
    assert store.load(f"{20:032x}")["result"] == json.loads(answer)


def test_an_entry_gone_between_the_lookup_and_the_hit_is_looked_up_again_as_a_miss(redis_client):
    keys = Keys("hits-gone")
    store = JobIntake(redis_client, keys, ttl_s=60)
    redis_client.set(keys.cache_entry("brief"), busy_answer(1))
    store._store_hit_job = lambda *args: (redis_client.delete(keys.cache_entry("brief")), [b"gone"])[1]
    verdict = store.answer_or_admit("1" * 32, hit_fields(), "brief", 60, {"total": 1.0}, ADMISSION)
    assert verdict.verdict == budget.ADMITTED and store.load("1" * 32) is None  # admitted: the API stores it next


def test_a_hit_that_must_reach_a_replica_is_stored_charged_and_refused_when_none_holds_it(redis_client):
    """Behind replication a hit's step runs through WAIT (JobIntake._script_and_wait): its reply read the same,
    and a bucket that is empty refuses it before any write, replicas or not."""
    from contract.redis.replication import NotReplicated, Replication

    keys = Keys("hits-wait")
    store = JobIntake(redis_client, keys, ttl_s=60, replication=Replication(1, 50), hits=HitLimits(1_200, 60, 60))
    redis_client.set(keys.cache_entry("small"), busy_answer(1))
    with pytest.raises(NotReplicated):  # no replica here: stored on the primary, not promised
        store.answer_or_admit("e" * 32, hit_fields(), "small", 60, {"total": 1.0}, ADMISSION, "a")
    assert store.load("e" * 32)["result"] == json.loads(busy_answer(1))
    limited = store.answer_or_admit("f" * 32, hit_fields(), "small", 60, {"total": 1.0}, ADMISSION, "a")
    assert limited.retry_after_ms > 0 and store.load("f" * 32) is None  # the first took the bucket's bytes


@pytest.fixture
def small_store(tmp_path) -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A Redis of 24 MB, noeviction, as `make run` sets a 1 GB one: the fill within a few hundred hits."""
    limits = ("--maxmemory", str(24 * 1024 * 1024), "--maxmemory-policy", "noeviction")
    server = RedisServer(tmp_path, extra_args=limits)
    client = redis.Redis(port=server.port)
    yield server, client
    client.close()
    server.stop()


KEYS = ({"id": "team-a", "sha256": hash_key("key-a")}, {"id": "team-b", "sha256": hash_key("key-b")})


def test_one_keys_flood_of_hits_is_refused_429_and_cannot_make_another_keys_submission_503(small_store):
    """The issue's attack, scaled down: key A repeats a 1,000-detection answer from 4 connections. Before, its
    hits stored a copy each until Redis passed store_full_ratio and every key got 503 store-full."""
    server, client = small_store
    settings = Settings(
        model=SPEC,
        models=(SPEC,),
        redis_url=server.url,
        namespace="flood",
        jobs=JobSettings(ttl_s=3600, max_ttl_s=3600, answer_bytes_per_key=128 * 1024),
    )
    image = jpeg(64, 64, seed=7)
    digest = ResultCache(client, Keys("flood"), settings).digest(image, SPEC, {}, "team-a")
    client.set(Keys("flood").cache_entry(digest), busy_answer(1000), ex=3600)
    with api_with_keys(settings, KEYS) as api:

        def submit(key: str, body: bytes = image) -> requests.Response:
            headers = {"Content-Type": "image/jpeg", "Authorization": f"Bearer {key}"}
            return requests.post(api.url + "/v1/jobs", data=body, headers=headers, timeout=30)

        before = client.info("memory")["used_memory"]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: submit("key-a"), range(400)))
        codes = [answer.status_code for answer in answers]
        assert set(codes) <= {202, 429} and codes.count(202) >= 30, sorted(set(codes))
        refused = next(answer for answer in answers if answer.status_code == 429)
        assert refused.headers["Content-Type"] == "application/problem+json"
        assert refused.json()["type"] == "/problems/rate-limited" and int(refused.headers["Retry-After"]) >= 1
        grown = client.info("memory")["used_memory"] - before
        assert grown < 2 * 1024 * 1024, grown  # was a 100 KB copy a hit: past the 21.6 MB of store_full_ratio
        memory = api_services(api.app).admission.memory
        # the API reads Redis's memory at most once a second: until its reading is one made after the flood
        wait_until(lambda: abs(memory.share() - memory._read()) < 0.02, 5, what="the API's memory reading")
        other = submit("key-b", jpeg(64, 64, seed=8))  # a miss: stored and queued
        assert other.status_code == 202, other.text
        hit = answers[0].json()
        assert hit["cache"] == "hit" and len(hit["result"]["detections"]) == 1000
        read = requests.get(f"{api.url}/v1/jobs/{hit['id']}", headers={"Authorization": "Bearer key-a"}, timeout=30)
        assert read.json()["result"] == hit["result"]


def test_callback_retries_never_keep_a_record_past_max_ttl_and_the_last_one_is_the_dead_letter(redis_client):
    """A receiver answering 500 pushed the record's lifetime out at each failed attempt (the wait plus
    jobs.ttl_s: 3,844 s left 300 s after the job, against 3,360): ~13 h by the defaults, then an hour more as a
    dead letter. Now never past jobs.max_ttl_s from its submission; a retry that would come later is not made.
    Each attempt a real POST to a receiver answering 500 (the callback worker's own `deliver`)."""
    from tests.conftest import CALLBACK_SECRET
    from tests.test_callbacks import Receiver

    settings = Settings(
        model=SPEC,
        models=(SPEC,),
        namespace="hits-cb",
        jobs=JobSettings(ttl_s=60, max_ttl_s=100),
        callbacks=CallbackSettings(
            secret=CALLBACK_SECRET, allow_hosts=("127.0.0.1",), backoff_base_s=20.0, jitter=0.0, max_attempts=24
        ),
    )
    keys = Keys("hits-cb")
    sender = CallbackSender(settings, redis_client)
    receiver = Receiver(failures=10**6)
    job_id = "c" * 32
    record = {"id": job_id, "status": SUCCEEDED, "received_at": time.time(), "callback_url": receiver.url}
    redis_client.hset(keys.job(job_id), mapping={**record, "result": json.dumps(json.loads(busy_answer(1)))})
    redis_client.expire(keys.job(job_id), 60)
    outcomes, left = [], []
    try:
        for _ in range(4):  # waits of 20, 40, 80, 160 s after the attempts: the 4th's would end past the bound
            outcomes.append(sender.deliver(job_id))
            left.append(redis_client.ttl(keys.job(job_id)))
    finally:
        receiver.stop()
    assert len(receiver.calls) == 4 and outcomes == ["retrying"] * 3 + ["failed"], outcomes
    assert max(left) <= 100, left  # was 20 + 60, 40 + 60, 80 + 60, then 60 more as the dead letter
    assert redis_client.zscore(keys.callback_dead, job_id) is not None
    assert "lapses first" in json.loads(redis_client.hget(keys.job(job_id), "callback"))["last_error"]


def test_a_dead_lettered_hit_keeps_a_reference_and_is_delivered_again_whole(redis_client):
    """The dead letter is the record, which for a hit holds the digest, not the answer: what a redelivery posts
    (the job's document) is read whole from the shared answer."""
    keys = Keys("hits-dead")
    store = JobIntake(redis_client, keys, ttl_s=60, hits=HitLimits(0, 60, 100))
    answer = busy_answer(1000)
    redis_client.set(keys.cache_entry("busy"), answer, ex=60)
    job_id = "d" * 32
    fields = hit_fields(callback_url="http://127.0.0.1:9/hook")
    assert store.answer_or_admit(job_id, fields, "busy", 60, {"total": 1.0}, ADMISSION).status == SUCCEEDED
    settings = Settings(model=SPEC, models=(SPEC,), namespace="hits-dead", jobs=JobSettings(ttl_s=60, max_ttl_s=100))
    sender = CallbackSender(settings, redis_client)
    assert sender._failed(job_id, {"attempts": 24, "first_at": time.time()}, "500", time.time() + 100, True) == "failed"
    assert redis_client.memory_usage(keys.job(job_id), samples=0) < 1_500  # was 83 KB: the answer's copy
    assert not redis_client.hexists(keys.job(job_id), "result")
    assert store.redeliver_callback(job_id) == 1
    assert store.load(job_id)["result"] == json.loads(answer)  # what the callback worker posts: job_document(load)


def test_a_dead_letter_keeps_what_a_read_and_a_redelivery_need_not_the_stages_bookkeeping(redis_client):
    """A computed job's record given up on: its document (what a read shows, what a redelivery posts) is the same
    after, its owner and callback too; the claim, the queue, the stamps its time bill was made of go."""
    from contract.documents import job_document
    from tasks.callbacks.delivery import DEAD_LETTER_DROPS

    keys = Keys("hits-drops")
    settings = Settings(model=SPEC, models=(SPEC,), namespace="hits-drops", jobs=JobSettings(ttl_s=60, max_ttl_s=100))
    store = JobIntake(redis_client, keys, ttl_s=60)
    job_id, now = "b" * 32, time.time()
    stamps = {"submitted_at": now, "cpu_started_at": now, "decode_ms": 3.0, "resize_ms": 1.0, "pushed_at": now}
    bookkeeping = {"claim": "t", "queue": "preprocess:box:1@a", "cache_key": "k", "media_type": "image/jpeg"}
    redis_client.hset(
        keys.job(job_id),
        mapping={
            **{name: str(value) for name, value in {**stamps, **bookkeeping}.items()},
            "id": job_id,
            "status": SUCCEEDED,
            "received_at": now,
            "finished_at": now,
            "owner": "a",
            "callback_url": "http://127.0.0.1:9/hook",
            "result": busy_answer(3),
            "timings": json.dumps({"receive": 1.0, "total": 9.0}),
            "bytes": 700,
        },
    )

    def shown() -> dict:  # the document, but for the callback's state (the attempt changes it)
        return {name: value for name, value in job_document(store.load(job_id)).items() if name != "callback"}

    before = shown()
    sender = CallbackSender(settings, redis_client)
    assert sender._failed(job_id, {"attempts": 1, "first_at": now}, "refused", now + 100, False) == "failed"
    left = {name.decode() for name in redis_client.hkeys(keys.job(job_id))}
    assert not left & set(DEAD_LETTER_DROPS) and {"owner", "callback_url", "result", "callback"} <= left
    assert shown() == before


def test_a_hit_with_a_callback_pays_for_each_ttl_its_record_may_live():
    limits = HitLimits(bucket_bytes=1000, ttl_s=3600, max_ttl_s=14400)
    assert limits.charge(300, has_callback=False) == 700 and limits.charge(300, has_callback=True) == 2800
    assert limits.answer_ttl_s == 14400 and limits.refill_per_s == pytest.approx(1000 / 3600)
    assert dataclasses.replace(limits, max_ttl_s=60).answer_ttl_s == 3600  # never shorter than a record's TTL
    assert ApiServer  # the module's HTTP tests run the real server
