"""Issue 70.2: fairness between API keys stopped at the CPU stage. One key's flood of tiny images filled a model's
frame list, and another key's photo waited behind all of it (p95 3.4 s, most of it `queue_gpu`). Now each key's
jobs claimed, waiting or in flight are counted (Keys.key_frames: in by the claim, out by the batch write, or by the
end of a claimed job whose frame was never pushed), and a frame whose key had fewer than
`backpressure.head_frames_per_key` goes to the head of the list: taken next. Nothing is refused for it: a key alone
still fills the list and every batch."""

from __future__ import annotations

import dataclasses
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
import requests
import yaml

from app import create_app
from app.auth import hash_key
from bench.stack.processes import ManagedProcess, RedisServer, gpu_worker_argv
from contract.frames import frame_push, read_job_id
from contract.frames.frame_shards import frame_pusher
from contract.jobs import expiry
from contract.jobs.handoff import JobHandOff
from contract.jobs.intake import JobIntake
from contract.jobs.record import CANCELLED
from contract.redis.keys import Keys
from contract.redis.shards import BulkPlane
from tasks.decoding.preprocess import Preprocessor
from tests.conftest import Stack, content_box_spec, start_stack, stop_stack
from tests.support import ApiServer, jpeg, wait_until

KEYS = ({"id": "flood", "sha256": hash_key("key-flood")}, {"id": "light", "sha256": hash_key("key-light")})
TERMINAL = {"succeeded", "failed", "expired", "cancelled"}


# --- the count, step by step (one Redis, and over a bulk shard) ------------------------------------------------
def _queued(intake: JobIntake, job: str, owner: str) -> None:
    intake.create(job, b"upload", 60, {"model": "m:1", "bytes": 6, "deadline_at": 1e12, "owner": owner})


def test_the_claim_counts_its_job_in_and_says_the_count_before_and_the_push_chooses_its_end_by_it(redis_client):
    keys = Keys("fair-steps")
    intake = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60, count_key_frames=True)
    pusher = frame_pusher(redis_client, keys)
    for job, owner in (("a1" * 16, "flood"), ("a2" * 16, "flood"), ("b1" * 16, "light"), ("c1" * 16, "")):
        _queued(intake, job, owner)
    first = handoff.claim_for_preprocessing("a1" * 16, 1.0, "c")
    assert (first.verdict, first.key_frames) == ("claimed", 0)
    assert pusher.push("a1" * 16, "m:1", b"a1", 10, {}, "c", head=True) == frame_push.PUSHED
    assert handoff.claim_for_preprocessing("a2" * 16, 1.0, "c").key_frames == 1
    assert pusher.push("a2" * 16, "m:1", b"a2", 10, {}, "c") == frame_push.PUSHED
    assert handoff.claim_for_preprocessing("b1" * 16, 1.0, "c").key_frames == 0
    assert pusher.push("b1" * 16, "m:1", b"b1", 10, {}, "c", head=True) == frame_push.PUSHED
    assert handoff.claim_for_preprocessing("c1" * 16, 1.0, "c").key_frames == -1  # no key: never counted
    assert pusher.push("c1" * 16, "m:1", b"c1", 10, {}, "c") == frame_push.PUSHED
    # taken from the right: the light key's frame first, then the flood's in the order they came
    assert redis_client.lrange(keys.frames("m:1"), 0, -1) == [b"c1", b"a2", b"a1", b"b1"]
    assert redis_client.hgetall(keys.key_frames("m:1")) == {b"flood": b"2", b"light": b"1"}
    assert 0 < redis_client.ttl(keys.key_frames("m:1")) <= frame_push.KEY_FRAMES_TTL_S  # drift heals once idle


def test_a_head_frame_passes_the_bound_and_one_that_may_not_stand_is_taken_back_from_its_end(redis_client):
    keys = Keys("fair-bound")
    intake = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60, count_key_frames=True)
    pusher = frame_pusher(redis_client, keys)
    redis_client.rpush(keys.frames("m:1"), b"x1", b"x2")  # the list at its bound of 2
    for job, owner in (("d1" * 16, "flood"), ("e1" * 16, "light")):
        _queued(intake, job, owner)
        handoff.claim_for_preprocessing(job, 1.0, "c")
    assert pusher.push("d1" * 16, "m:1", b"d1", 2, {}, "c") == frame_push.LIST_FULL  # a tail frame waits for room
    assert pusher.push("e1" * 16, "m:1", b"e1", 2, {}, "other claim", head=True) == frame_push.JOB_OVER
    assert redis_client.lrange(keys.frames("m:1"), 0, -1) == [b"x1", b"x2"]  # each taken back, from its own end
    assert pusher.push("e1" * 16, "m:1", b"e1", 2, {}, "c", head=True) == frame_push.PUSHED  # past the bound
    assert redis_client.lrange(keys.frames("m:1"), 0, -1) == [b"x1", b"x2", b"e1"]
    # a claimed job counts whether its frame waits for room or stood: the push counts nothing
    assert redis_client.hgetall(keys.key_frames("m:1")) == {b"flood": b"1", b"light": b"1"}


def test_over_a_bulk_shard_the_head_is_the_shards_and_the_count_the_control_planes(redis_client, redis_server):
    control = redis_client
    shard = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/15")
    shard.flushdb()
    keys = Keys("fair-shard")
    bulk = BulkPlane(control, [shard])
    intake = JobIntake(control, keys, ttl_s=60, bulk=bulk)
    handoff = JobHandOff(control, keys, ttl_s=60, bulk=bulk, count_key_frames=True)
    pusher = frame_pusher(control, keys, bulk)
    for job, owner in (("f1" * 16, "flood"), ("g1" * 16, "light")):
        intake.create(job, b"upload", 60, {"model": "m:1", "bytes": 6, "deadline_at": 1e12, "owner": owner})
    shard.rpush(keys.frames("m:1"), b"x1")  # the shard's list at its bound of 1
    assert handoff.claim_for_preprocessing("f1" * 16, 1.0, "c").key_frames == 0
    assert pusher.push("f1" * 16, "m:1", b"f1", 1, {}, "c") == frame_push.LIST_FULL
    assert handoff.claim_for_preprocessing("g1" * 16, 1.0, "c").key_frames == 0
    assert pusher.push("g1" * 16, "m:1", b"g1", 1, {}, "c", head=True) == frame_push.PUSHED
    assert shard.lrange(keys.frames("m:1"), 0, -1) == [b"x1", b"g1"]
    assert control.hgetall(keys.key_frames("m:1")) == {b"flood": b"1", b"light": b"1"}  # claimed: counted
    handoff.fail("f1" * 16, "bad_image", "its frame never stood")  # counted out by its end
    assert control.hgetall(keys.key_frames("m:1")) == {b"light": b"1"}
    shard.close()


def _counts(client: redis.Redis, keys: Keys) -> dict[str, int]:
    return {name.decode(): int(count) for name, count in client.hgetall(keys.key_frames("m:1")).items()}


def test_each_claimed_job_that_ends_before_its_push_counts_itself_out_and_a_second_claim_counts_nothing(redis_client):
    """The paths on which a claimed job never pushes a frame: a failed decode (the job fails), its deadline passed
    while it waited for room (it expires), a cancel; a redelivered task's claim of a job claimed before adds nothing,
    and the first attempt's push then finds the job claimed again (JOB_OVER): the one count goes with the second
    attempt's push, out by the batch write. A job without a key, or one that ended before its claim, is never
    counted, and no end counts out what it did not count in."""
    keys = Keys("fair-out")
    intake = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60, count_key_frames=True)
    pusher = frame_pusher(redis_client, keys)
    failed, late, cancelled, again, keyless, never = ("h1" * 16, "h2" * 16, "h3" * 16, "h4" * 16, "h5" * 16, "h6" * 16)
    for job in (failed, late, cancelled, again, never):
        _queued(intake, job, "k")
    _queued(intake, keyless, "")
    assert [handoff.claim_for_preprocessing(job, 1.0, "c").key_frames for job in (failed, late, cancelled)] == [0, 1, 2]
    assert handoff.claim_for_preprocessing(keyless, 1.0, "c").key_frames == -1
    assert _counts(redis_client, keys) == {"k": 3}
    handoff.fail(failed, "bad_image", "not an image")
    expiry.expire(handoff, late, expiry.WAITING_FOR_ROOM)
    handoff.finish(cancelled, CANCELLED, {"error": {"code": "cancelled", "message": "cancelled by the client"}})
    handoff.fail(keyless, "bad_image", "not an image")
    handoff.finish(never, CANCELLED, {})  # still queued: never claimed, never counted
    assert _counts(redis_client, keys) == {}  # each counted out; the count at 0 is deleted, not left at 0 or below
    assert handoff.claim_for_preprocessing(again, 1.0, "first").key_frames == 0
    assert handoff.claim_for_preprocessing(again, 2.0, "second").key_frames == 0  # itself not counted twice
    assert _counts(redis_client, keys) == {"k": 1}
    assert pusher.push(again, "m:1", b"again-1", 10, {}, "first") == frame_push.JOB_OVER
    assert pusher.push(again, "m:1", b"again-2", 10, {}, "second") == frame_push.PUSHED
    assert _counts(redis_client, keys) == {"k": 1}  # the push counted nothing: the frame is its claim's
    handoff.fail(again, "bad_image", "too late to count out")  # pushed: its frame is counted out by its batch
    assert _counts(redis_client, keys) == {"k": 1}


# --- through the stack -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fair_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The content-box pipeline with a frame list of 12, batches of 8, and a key's first 2 frames waiting or in flight
    pushed to the head; its API (in this process) knows two API keys. The CPU worker's config names none, so it
    takes every key's jobs from the shared queue: these tests are about the GPU stage, not a key's own queue."""
    workdir = tmp_path_factory.mktemp("fair-gpu")
    url = redis_server.url.rsplit("/", 1)[0] + "/14"
    redis.Redis.from_url(url).flushdb()
    extra = {"backpressure": {"max_frames": 12, "head_frames_per_key": 2}}
    stack = start_stack(url, workdir, content_box_spec(workdir, 64), "fairgpu", extra)
    auth = dataclasses.replace(stack.settings.auth, rate_per_s=0.0, api_keys=KEYS)
    stack.api.stop()
    stack.api = ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth)))
    yield stack
    stop_stack(stack)


def _submit(stack: Stack, key: str, seed: int) -> str:
    response = requests.post(
        stack.url("/v1/jobs"),
        data=jpeg(96, 64, seed=seed),
        headers={"Authorization": f"Bearer key-{key}", "Content-Type": "image/jpeg"},
        timeout=30,
    )
    assert response.status_code == 202, response.text  # nothing is refused for the count
    return str(response.json()["id"])


def _ended(stack: Stack, key: str, job_id: str, within_s: float = 90.0) -> dict[str, Any]:
    docs: list[dict[str, Any]] = []

    def ended() -> bool:
        response = requests.get(
            stack.url(f"/v1/jobs/{job_id}"),
            params={"wait": 5},
            headers={"Authorization": f"Bearer key-{key}"},
            timeout=30,
        )
        docs.append(response.json())
        return docs[-1]["status"] in TERMINAL

    wait_until(ended, within_s, what=f"job {job_id} to end")
    return docs[-1]


def _counted(stack: Stack) -> dict[str, int]:
    held = stack.redis.hgetall(stack.keys.key_frames(stack.settings.model.key))
    return {name.decode(): int(count) for name, count in held.items()}


def _queued_gpu(stack: Stack, count: int) -> None:
    wait_until(lambda: stack.redis.llen(stack.frames_key) >= count, 60, what=f"{count} frames in the list")


def test_a_light_keys_frame_is_taken_before_a_flooding_keys_waiting_frames(fair_stack):
    stack = fair_stack
    stack.stop_gpu_worker()
    try:
        flood = [_submit(stack, "flood", seed) for seed in range(8)]
        _queued_gpu(stack, 8)  # the flood's frames waiting
        light = _submit(stack, "light", 100)
        _queued_gpu(stack, 9)
        assert _counted(stack) == {"flood": 8, "light": 1}
        assert read_job_id(stack.redis.lindex(stack.frames_key, -1)) == light  # the head: taken next
    finally:
        stack.start_gpu_worker()
    light_doc = _ended(stack, "light", light)
    flood_docs = [_ended(stack, "flood", job_id) for job_id in flood]
    assert [doc["status"] for doc in [light_doc, *flood_docs]] == ["succeeded"] * 9
    # the light key's frame was in the first batch taken, first in it; the flood's last frames in a later one
    assert light_doc["batch"]["index"] == 0
    assert light_doc["batch"]["seq"] <= min(doc["batch"]["seq"] for doc in flood_docs)
    assert light_doc["batch"]["seq"] < max(doc["batch"]["seq"] for doc in flood_docs)
    assert _counted(stack) == {}  # every frame counted out with its batch: no drift


def test_a_lone_key_fills_the_list_and_every_batch(fair_stack):
    """The count throttles nobody: one key alone fills the list (the earlier cap on a key's share held it to a part
    of the list, and the GPU to a part of its batch) and its frames run in full batches, none refused."""
    stack = fair_stack
    stack.stop_gpu_worker()
    try:
        jobs = [_submit(stack, "flood", 200 + seed) for seed in range(16)]
        # as full as the CPU worker fills it: it stops taking the model's jobs once the list lacks room for the two
        # its children may hold (tasks.hop.full_lists)
        _queued_gpu(stack, 12 - 2)
        # the bound; the key's first frames went to the head (2, and one more when both CPU children claimed at once)
        assert stack.redis.llen(stack.frames_key) <= 12 + 3
        # its frames waiting, and the jobs the CPU worker's two children claimed and hold for room
        depth = stack.redis.llen(stack.frames_key)
        assert depth <= _counted(stack)["flood"] <= depth + 2
    finally:
        stack.start_gpu_worker()
    docs = [_ended(stack, "flood", job_id) for job_id in jobs]
    assert [doc["status"] for doc in docs] == ["succeeded"] * 16
    first_batch = min(doc["batch"]["seq"] for doc in docs)
    assert [doc["batch"]["size"] for doc in docs if doc["batch"]["seq"] == first_batch][0] == 8
    assert _counted(stack) == {}


def test_a_job_that_fails_its_decode_counts_itself_out(fair_stack):
    """Claimed, so counted; its decode fails and it pushes no frame: its end counts it out, and the key's count is
    back to 0 (deleted) with nothing in flight."""
    stack = fair_stack
    corrupt = jpeg(96, 64, seed=7)[:300] + random.Random(7).randbytes(500)
    response = requests.post(
        stack.url("/v1/jobs"),
        data=corrupt,
        headers={"Authorization": "Bearer key-light", "Content-Type": "image/jpeg"},
        timeout=30,
    )
    assert response.status_code == 202, response.text
    doc = _ended(stack, "light", str(response.json()["id"]))
    assert doc["status"] == "failed", doc
    assert _counted(stack) == {}


def _room_preprocessor(stack: Stack, namespace: str) -> tuple[Preprocessor, Keys, JobIntake]:
    """The CPU worker's own Preprocessor (in this process) on the stack's Redis, in a namespace of its own whose
    frame list of 1 is full: a job it claims decodes, then waits for room."""
    settings = dataclasses.replace(
        stack.settings,
        namespace=namespace,
        backpressure=dataclasses.replace(stack.settings.backpressure, max_frames=1, room_poll_s=0.01),
    )
    keys = Keys(namespace)
    stack.redis.rpush(keys.frames(settings.model.key), b"a frame the list holds")
    return Preprocessor(settings, stack.redis), keys, JobIntake(stack.redis, keys, ttl_s=60)


@pytest.mark.parametrize("end", ["cancelled", "expired"])
def test_a_claimed_job_that_ends_while_it_waits_for_room_counts_itself_out(fair_stack, end):
    """Claimed, so counted, though no frame of its stands: cancelled while its CPU worker waits for room (its push
    then finds it over), or expired there at its deadline, it counts itself out. Its key has two frames in flight
    already (the stack's head_frames_per_key): its frame goes to the tail, and waits."""
    stack = fair_stack
    preprocessor, keys, intake = _room_preprocessor(stack, f"fair-room-{end}")
    model, job = stack.settings.model.key, ("e" if end == "expired" else "c") * 32
    stack.redis.hset(keys.key_frames(model), "flood", 2)
    deadline_at = time.time() + (3.0 if end == "expired" else 600.0)
    fields = {"model": model, "bytes": 4096, "deadline_at": deadline_at, "owner": "flood", "options": {}}
    intake.create(job, jpeg(96, 64, seed=9), 60, fields)

    def counted() -> dict[bytes, bytes]:
        return stack.redis.hgetall(keys.key_frames(model))

    with ThreadPoolExecutor(1) as pool:
        outcome = pool.submit(preprocessor.run, job)
        wait_until(lambda: counted() == {b"flood": b"3"}, 30, what="the job claimed and counted")
        if end == "cancelled":
            assert stack.redis.hget(keys.job(job), "status") == b"preprocessing"  # its frame at the tail: no room
            ending = JobHandOff(stack.redis, keys, ttl_s=60)
            assert ending.finish(job, CANCELLED, {"error": {"code": "cancelled", "message": "by the client"}})
            assert counted() == {b"flood": b"2"}  # counted out by its end, before its push knows
            stack.redis.delete(keys.frames(model))  # room: the push is tried and finds the job over
        result = outcome.result(timeout=60)
    assert stack.redis.hget(keys.job(job), "status") == end.encode(), result
    assert counted() == {b"flood": b"2"}  # the two in flight, and no more
    assert stack.redis.llen(keys.frames(model)) == (0 if end == "cancelled" else 1)  # no frame of its stood


def _slow_gpu_worker(stack: Stack, name: str, batch_ms: int = 1500) -> ManagedProcess:
    """A GPU worker on the stack's list, simulated, 1.5 s a batch: easy to kill with a batch in hand."""
    config = yaml.safe_load(stack.config_path.read_text())
    config["gpu_worker"] = {**config.get("gpu_worker", {}), "sim_latency_ms": {1: batch_ms, 8: batch_ms}}
    path = stack.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    worker = ManagedProcess(
        name, gpu_worker_argv("sim", name), {**stack.env, "IMGSERVE_CONFIG": str(path)}, stack.log_dir
    )
    wait_until(
        lambda: stack.redis.exists(stack.keys.heartbeat(name)) or not worker.alive(), 60, what=f"{name}'s heartbeat"
    )
    assert worker.alive(), worker.log_tail()
    return worker


def test_a_gpu_worker_killed_mid_batch_leaves_its_frames_counted_until_they_are_answered(fair_stack):
    """Frames in a dead worker's hands are still waiting: counted while they lie in its processing list and after
    they are moved back, counted out once by the batch that answers them."""
    stack = fair_stack
    stack.stop_gpu_worker()
    held = stack.keys.processing("fair-killable", stack.settings.model.key)
    restarted = None
    try:
        worker = _slow_gpu_worker(stack, "fair-killable")
        jobs = [("flood", _submit(stack, "flood", 300 + seed)) for seed in range(6)]
        jobs += [("light", _submit(stack, "light", 400 + seed)) for seed in range(2)]
        wait_until(lambda: stack.redis.llen(held) > 0, 60, what="a batch in hand")
        worker.stop(signal.SIGKILL)
        wait_until(  # in its hands, or waiting
            lambda: stack.redis.llen(held) + stack.redis.llen(stack.frames_key) == 8, 60, what="every frame pushed"
        )
        assert sum(_counted(stack).values()) == 8
        restarted = _slow_gpu_worker(stack, "fair-killable")  # moves its own frames back first
        docs = [_ended(stack, key, job_id) for key, job_id in jobs]
        assert [doc["status"] for doc in docs] == ["succeeded"] * 8
        assert _counted(stack) == {} and stack.redis.llen(held) == 0
    finally:
        if restarted is not None:
            restarted.stop()
        stack.start_gpu_worker()


def test_under_a_flood_the_gpu_worker_holds_one_batch_ahead_of_the_one_on_the_device(fair_stack):
    """Saturated, the worker holds the batch on the device and one staged behind it (2 x 8 frames), enough to keep the
    device busy; it held up to four closed batches before, each only waiting longer for the device, with frames that,
    left in the list, a light key's would go ahead of."""
    stack = fair_stack
    stack.stop_gpu_worker()
    held = stack.keys.processing("fair-bounded", stack.settings.model.key)
    worker = None
    samples: list[int] = []
    try:
        jobs = [_submit(stack, "flood", 500 + seed) for seed in range(40)]
        _queued_gpu(stack, 10)  # the list full: the CPU worker refills it as fast as the GPU worker takes
        # A device slow beside any host (1 s a batch): the lane holds one batch ahead only while its host stages a
        # batch in half the device's time (gpu_worker.lanes), and a loaded CI machine's took more than 150 ms.
        worker = _slow_gpu_worker(stack, "fair-bounded", batch_ms=1000)

        def sample() -> int:
            samples.append(int(stack.redis.llen(held)))
            return samples[-1]

        def ended() -> bool:
            sample()
            pipe = stack.redis.pipeline(transaction=False)
            for job_id in jobs:
                pipe.hget(stack.keys.job(job_id), "status")
            return all(status is not None and status.decode() in TERMINAL for status in pipe.execute())

        wait_until(lambda: sample() >= 16, 60, interval_s=0.005, what="a batch staged while one runs")
        wait_until(ended, 90, interval_s=0.005, what="the flood answered")
        # 16 but for the moments a batch off the device waits for its write (its frames still listed): never 3 more
        assert sorted(samples)[len(samples) * 95 // 100] <= 16 and max(samples) <= 24, sorted(set(samples))
        assert _counted(stack) == {}
    finally:
        if worker is not None:
            worker.stop()
        stack.start_gpu_worker()


def test_a_light_keys_frame_pushed_while_a_batch_runs_waits_for_that_batch_only(fair_stack):
    """Saturated, the next batch is popped just before the device is free, not as soon as the one before it reached
    the device: a light key's frame pushed to the head while a batch runs goes into the next batch, not the one after
    it (before, the next was already popped and staged, and the light frame waited a whole batch more in its own)."""
    stack = fair_stack
    stack.stop_gpu_worker()
    worker = None
    try:
        # In Celery's order (one shared queue): each light job is decoded while the flood keeps the list full
        flood: list[str] = []
        light: list[str] = []
        for part in range(3):
            flood += [_submit(stack, "flood", 600 + 100 * part + seed) for seed in range(24 if part == 0 else 16)]
            light.append(_submit(stack, "light", 900 + part))
        flood += [_submit(stack, "flood", 950 + seed) for seed in range(16)]
        _queued_gpu(stack, 10)
        worker = _slow_gpu_worker(stack, "fair-in-time", batch_ms=1000)
        light_docs = [_ended(stack, "light", job_id) for job_id in light]
        flood_docs = [_ended(stack, "flood", job_id, within_s=120) for job_id in flood]
    finally:
        if worker is not None:
            worker.stop()
        stack.start_gpu_worker()
    assert [doc["status"] for doc in light_docs + flood_docs] == ["succeeded"] * len(light + flood)
    # A full batch waits for the device a moment (the host's lead), not the whole of the batch ahead (1 s)
    waits = sorted(doc["timings_ms"]["device_queue"] for doc in flood_docs)
    assert waits[len(waits) // 2] < 250, waits
    # Each light frame ran in the batch after the one it was pushed behind: no whole batch in between on the device.
    # (One may be pushed in the moment its next batch was being popped: it then waits one more.)
    light_waits = [doc["timings_ms"]["device_queue"] for doc in light_docs]
    assert sum(wait < 500 for wait in light_waits) >= 2, light_waits
    assert all(doc["batch"]["size"] == 8 for doc in light_docs)  # the flood was still on when each came
    assert _counted(stack) == {}
