"""Bulk shards (contract.redis.shards): uploads and frames over several Redis servers, the control plane on one.

Real redis-servers throughout: the parts against three shards of their own, then the whole stack on a control
Redis and three shards, one of which is killed under load."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import requests

from app.services import services as api_services
from bench.stack.processes import RedisServer
from contract.frames import FrameHeader, pack_frame, read_job_id
from contract.frames import frame_push as frames
from contract.frames.frame_shard_source import ShardedFrameSource
from contract.frames.frame_shards import frame_pusher
from contract.frames.frame_source import requeue_frames_of
from contract.jobs.ending import JobEnding
from contract.jobs.handoff import JobHandOff
from contract.jobs.intake import JobIntake
from contract.jobs.record import QUEUED, QUEUED_GPU, RUNNING, new_job_id
from contract.redis.keys import Keys
from contract.redis.shards import SHARDED_UPLOAD, UPLOAD_FIELD, BulkPlane, ShardUnavailable, shard_of
from tasks.hop.shard_watch import ShardWatch
from tests.conftest import STACK_INPUT_SIZE, content_box_spec, start_stack, stop_stack
from tests.support import free_port, jpeg, wait_until

MODEL = "m:1"


def test_placement_is_the_job_ids_alone_and_spreads_evenly():
    ids = [new_job_id() for _ in range(3000)]
    counts = collections.Counter(shard_of(job_id, 3) for job_id in ids)
    assert set(counts) == {0, 1, 2}
    assert all(800 <= count <= 1200 for count in counts.values()), counts
    assert all(shard_of(job_id, 3) == shard_of(job_id, 3) for job_id in ids[:50])
    assert {shard_of(job_id, 1) for job_id in ids[:50]} == {0}


def test_new_job_ids_avoid_a_shard_found_down_until_its_retry():
    now = [100.0]
    plane = BulkPlane(redis.Redis(), [redis.Redis(), redis.Redis(), redis.Redis()], retry_s=1.0, clock=lambda: now[0])
    plane.mark_down(1)
    assert all(plane.index(plane.new_job_id(new_job_id)) != 1 for _ in range(200))
    now[0] += 1.5
    assert 1 in {plane.index(plane.new_job_id(new_job_id)) for _ in range(200)}
    assert plane.frame_bound(64) == 22 and BulkPlane(redis.Redis()).frame_bound(64) == 64


@pytest.fixture(scope="module")
def shard_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    servers = [RedisServer(tmp_path_factory.mktemp(f"shard{i}")) for i in range(3)]
    yield servers
    for server in servers:
        if server.process.poll() is None:
            server.stop()


@pytest.fixture
def plane(redis_client: redis.Redis, shard_servers: list[RedisServer]) -> BulkPlane:
    shards = [redis.Redis.from_url(server.url, socket_timeout=2) for server in shard_servers]
    for shard in shards:
        shard.flushdb()
    return BulkPlane(redis_client, shards, retry_s=0.5)


def _job_on(plane: BulkPlane, index: int) -> str:
    return next(job_id for job_id in iter(new_job_id, "") if plane.index(job_id) == index)


def _stored_job(store: JobIntake, plane: BulkPlane, index: int, upload: bytes = b"u" * 1000) -> str:
    job_id = _job_on(plane, index)
    store.create(
        job_id,
        upload,
        600,
        {"model": MODEL, "bytes": len(upload), "deadline_at": time.time() + 60, "submitted_at": time.time()},
    )
    return job_id


def test_a_jobs_upload_and_frame_live_on_its_shard_and_its_record_on_the_control_plane(redis_client, plane):
    keys = Keys("sharded")
    store = JobIntake(redis_client, keys, 600, bulk=plane)
    handoff = JobHandOff(redis_client, keys, 600, bulk=plane)
    pusher = frame_pusher(redis_client, keys, plane)
    job_id = _stored_job(store, plane, 2)
    shard = plane.clients[2]
    assert shard.get(keys.upload(job_id)) == b"u" * 1000
    # a hash table from its first field (configs/redis.conf): each step finds a field without a walk of the record
    assert redis_client.object("encoding", keys.job(job_id)) == b"hashtable"
    assert {b"status", b"model", b"deadline_at", b"bytes", b"upload"} <= set(redis_client.hkeys(keys.job(job_id)))
    # the marker the job steps read: a field of the record, no key of its own
    assert redis_client.hget(keys.job(job_id), UPLOAD_FIELD) == SHARDED_UPLOAD
    assert not redis_client.exists(keys.upload(job_id))
    assert not plane.clients[0].exists(keys.upload(job_id)) and not redis_client.exists(keys.frames(MODEL))
    verdict, upload, _, _ = handoff.claim_for_preprocessing(job_id, time.time(), "c1")
    assert verdict == "claimed" and bytes(upload) == b"u" * 1000
    redis_client.hset(keys.waiting_bytes, mapping={MODEL: 1000, "*": 1000})
    assert pusher.push(job_id, MODEL, b"F" * 300, 64, {"pushed_at": 1.0}, "c1") == frames.PUSHED
    assert shard.lrange(keys.frames(MODEL), 0, -1) == [b"F" * 300]
    record = store.load(job_id)
    assert record["status"] == QUEUED_GPU and record["pushed_at"] == 1.0
    assert redis_client.hget(keys.job(job_id), UPLOAD_FIELD) == b""  # taken by the push's own HSET
    assert not redis_client.exists(keys.upload(job_id))  # the marker went: the upload's bytes wait no more
    assert redis_client.hget(keys.waiting_bytes, MODEL) == b"300"  # the frame's bytes wait instead
    assert redis_client.hget(keys.frames_waiting, MODEL) == b"1"  # counted where the backlog reads it


def test_a_shards_share_of_the_bound_holds_and_a_frame_that_may_not_stand_is_taken_back(redis_client, plane):
    keys = Keys("bound")
    store = JobIntake(redis_client, keys, 600, bulk=plane)
    handoff = JobHandOff(redis_client, keys, 600, bulk=plane)
    pusher = frame_pusher(redis_client, keys, plane)
    first, second, over = (_stored_job(store, plane, 0) for _ in range(3))
    for job_id in (first, second, over):
        handoff.claim_for_preprocessing(job_id, time.time(), "c")
    # max_frames 4 over 3 shards: 2 on each.
    assert pusher.push(first, MODEL, b"1" * 10, 4, {}, "c") == frames.PUSHED
    assert pusher.push(second, MODEL, b"2" * 10, 4, {}, "c") == frames.PUSHED
    assert pusher.push(over, MODEL, b"3" * 10, 4, {}, "c") == frames.LIST_FULL
    assert not pusher.has_room(over, MODEL, 4)
    plane.clients[0].rpop(keys.frames(MODEL))
    store.fail(over, "test", "ended meanwhile")
    assert pusher.push(over, MODEL, b"3" * 10, 4, {}, "c") == frames.JOB_OVER
    assert plane.clients[0].lrange(keys.frames(MODEL), 0, -1) == [b"2" * 10]  # taken back


def test_a_shard_that_does_not_answer_is_a_clear_error_and_is_avoided(redis_client):
    keys = Keys("down")
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    plane = BulkPlane(redis_client, [dead], retry_s=5.0)
    store = JobIntake(redis_client, keys, 600, bulk=plane)
    with pytest.raises(ShardUnavailable, match=r"bulk.redis_urls\[0\]") as raised:
        store.create(new_job_id(), b"x", 600, {"model": MODEL})
    assert "127.0.0.1" not in str(raised.value)  # a job's error names no address (clients read it)
    assert not plane.is_up(0) and redis_client.dbsize() == 0  # nothing stored for it on the control plane


def _push_frame(client: redis.Redis, keys: Keys, job_id: str) -> None:
    header = FrameHeader(
        job_id=job_id,
        width=8,
        height=8,
        pad_left=0,
        pad_top=0,
        scale_x=1.0,
        scale_y=1.0,
        orig_width=8,
        orig_height=8,
        deadline_at=time.time() + 60,
    )
    client.lpush(keys.frames(MODEL), pack_frame(header, bytes(8 * 8 * 3)))


def test_the_gpu_source_takes_from_every_shard_and_acks_each_by_count(redis_client, plane):
    keys = Keys("source")
    source = ShardedFrameSource(plane, keys, "w1", MODEL)
    pushed = {index: [_job_on(plane, index) for _ in range(3)] for index in range(3)}
    for index, ids in pushed.items():
        for job_id in ids:
            _push_frame(plane.clients[index], keys, job_id)
            plane.clients[index].set(keys.upload(job_id), b"upload")
    looks = [source.pop_available(6) for _ in range(3)]  # one shard a look, in turn
    assert [len(look) for look in looks] == [3, 3, 3]
    assert len({plane.index(read_job_id(look[0])) for look in looks}) == 3
    taken = [frame for look in looks for frame in look]
    by_shard = collections.defaultdict(list)
    for frame in taken:
        job_id = read_job_id(frame)
        by_shard[plane.index(job_id)].append(job_id)
    assert dict(by_shard) == pushed  # every shard drained, each in its own order (oldest first)
    source.ack(5)
    remaining = sum(plane.clients[i].llen(keys.processing("w1", MODEL)) for i in range(3))
    assert remaining == 4
    assert len(source.in_hand) == 4
    uploads_left = sum(plane.clients[i].exists(keys.upload(j)) for i in range(3) for j in pushed[i])
    assert uploads_left == 4  # the acked frames' uploads went with them, the others' wait


def test_a_blocked_gpu_source_wakes_for_a_frame_on_any_shard(redis_client, plane):
    keys = Keys("wake")
    source = ShardedFrameSource(plane, keys, "w1", MODEL)
    job_id = _job_on(plane, 2)
    timer = threading.Timer(0.3, lambda: _push_frame(plane.clients[2], keys, job_id))
    timer.start()
    started = time.monotonic()
    frame = source.pop_blocking(5.0)
    assert frame is not None and read_job_id(frame) == job_id
    assert time.monotonic() - started < 4.0  # woken by the frame, not by the timeout


def test_a_dead_shard_is_skipped_and_the_others_still_feed_the_gpu(redis_client, shard_servers):
    keys = Keys("skip")
    live = redis.Redis.from_url(shard_servers[0].url)
    live.flushdb()
    plane = BulkPlane(redis_client, [live, redis.Redis(port=free_port(), socket_connect_timeout=0.5)], retry_s=5.0)
    source = ShardedFrameSource(plane, keys, "w1", MODEL)
    job_id = _job_on(plane, 0)
    _push_frame(live, keys, job_id)
    frames = source.pop_available(4) + source.pop_available(4)  # one look at each
    assert [read_job_id(frame) for frame in frames] == [job_id]
    assert not plane.is_up(1)
    assert source.pop_blocking(0.2) is None  # nothing more, and no error from the dead one


def test_a_dead_workers_frames_go_back_on_every_shard_with_an_attempt_counted(redis_client, plane):
    keys = Keys("reap")
    store = JobIntake(redis_client, keys, 600, bulk=plane)
    ids = [_stored_job(store, plane, index) for index in range(3)]
    for job_id in ids:
        shard = plane.client_for(job_id)
        _push_frame(shard, keys, job_id)
        shard.lmove(keys.frames(MODEL), keys.processing("dead", MODEL), "RIGHT", "LEFT")
    redis_client.zadd(keys.gpu_workers, {"dead": 1.0})
    assert requeue_frames_of(redis_client, keys, "dead", [MODEL], only_if_dead=True, bulk=plane) == 3
    for job_id in ids:
        assert plane.client_for(job_id).llen(keys.frames(MODEL)) == 1
        assert redis_client.hget(keys.job(job_id), "attempts") == b"1"
    assert redis_client.zscore(keys.gpu_workers, "dead") is None
    redis_client.set(keys.heartbeat("alive"), "x")
    assert requeue_frames_of(redis_client, keys, "alive", [MODEL], only_if_dead=True, bulk=plane) == -1


def test_the_loss_of_a_shard_is_dated_at_its_restart_even_just_after_the_watchs_last_look():
    # Restarted since the last look, or first seen: its restart. Its uptime is whole seconds, so a restart
    # within a second after the last look dates before it: the look, since the server can only have started
    # after it; the jobs the API placed on the new server since then are not the lost ones. Emptied while it
    # ran (no restart: a long uptime): some moment before now.
    assert ShardWatch.lost_at(None, 90.0, 100.0) == 90.0
    assert ShardWatch.lost_at(80.0, 90.0, 100.0) == 90.0
    assert ShardWatch.lost_at(99.5, 98.9, 100.0) == 99.5
    assert ShardWatch.lost_at(99.5, 50.0, 100.0) == 100.0


def test_the_watch_ends_the_jobs_a_restarted_or_unreachable_shard_took_and_no_others(redis_client, plane):
    keys = Keys("watch")
    store = JobIntake(redis_client, keys, 600, bulk=plane)
    watch = ShardWatch(redis_client, plane, keys, store, grace_s=1.0)
    on = {index: _stored_job(store, plane, index) for index in range(3)}
    assert watch.check() == {}  # first look: every shard's life noted
    plane.clients[1].flushdb()  # shard 1 restarted without its data (its uptime would not say so: the life token does)
    assert wait_until(watch.check, 10, what="the watch to find shard 1's data lost") == {1: 1}
    assert store.load(on[1])["error"]["code"] == "shard_lost"
    assert store.load(on[0])["status"] == store.load(on[2])["status"] == QUEUED
    later = _stored_job(store, plane, 1)  # placed after the loss: untouched
    assert watch.check() == {} and store.load(later)["status"] == QUEUED
    gone = BulkPlane(
        redis_client, [plane.clients[0], redis.Redis(port=free_port(), socket_connect_timeout=0.3)], retry_s=0.1
    )
    keys = Keys("watch-gone")  # the jobs above would fall on other shards of a two-shard plane
    store = JobEnding(redis_client, keys, 600, bulk=gone)
    watch = ShardWatch(redis_client, gone, keys, store, grace_s=0.5)
    stranded = next(job_id for job_id in iter(new_job_id, "") if gone.index(job_id) == 1)
    redis_client.hset(
        keys.job(stranded),
        mapping={"id": stranded, "status": "queued_gpu", "deadline_at": time.time() + 60, "submitted_at": time.time()},
    )
    redis_client.zadd(keys.deadlines, {stranded: time.time() + 60})
    assert watch.check() == {}  # within its grace
    wait_until(lambda: watch.check() == {1: 1}, 10, what="the grace to pass")
    assert store.load(stranded)["error"]["code"] == "shard_unavailable"


# --- the whole stack on three shards ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_stack(shard_servers, redis_server, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("sharded-stack")
    for server in shard_servers:
        if server.process.poll() is not None:
            server.start()
        redis.Redis.from_url(server.url).flushdb()
    model = content_box_spec(workdir, STACK_INPUT_SIZE, weights="test fixture", conf=0.25, iou=0.45, max_det=10)
    url = redis_server.url.rsplit("/", 1)[0] + "/9"
    redis.Redis.from_url(url).flushdb()
    stack = start_stack(
        url,
        workdir,
        model,
        "sharded",
        {"bulk": {"redis_urls": [server.url for server in shard_servers], "grace_s": 2.0, "retry_s": 0.5}},
    )
    yield stack
    stop_stack(stack)


def test_the_stack_spreads_jobs_over_the_shards_and_loses_none_when_one_dies(sharded_stack, shard_servers):
    stack = sharded_stack
    image = jpeg(640, 480)
    ids: list[str] = []
    while (
        min(collections.Counter(shard_of(job_id, 3) for job_id in ids).values() or [0]) < 2
        or len({shard_of(job_id, 3) for job_id in ids}) < 3
    ):
        ids.append(stack.submit_ok(image))
        assert len(ids) < 60
    assert all(stack.wait_terminal(job_id)["status"] == "succeeded" for job_id in ids)
    pushes = [
        int(redis.Redis.from_url(s.url).info("commandstats").get("cmdstat_lpush", {}).get("calls", 0))
        for s in shard_servers
    ]
    assert all(count > 0 for count in pushes), pushes  # every shard carried frames

    # Under load, shard 1 dies: its jobs fail with a clear code, every other job succeeds, none is lost.
    accepted: list[str] = []
    refused: list[int] = []
    stop = threading.Event()

    def client() -> None:
        session = requests.Session()
        while not stop.is_set():
            response = session.post(stack.url("/v1/jobs"), files={"image": ("i", image, "image/jpeg")}, timeout=30)
            if response.status_code == 202:
                accepted.append(response.json()["id"])
            else:
                refused.append(response.status_code)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client) for _ in range(4)]
        wait_until(lambda: len(accepted) >= 20, 60, what="jobs before the kill")
        shard_servers[1].process.kill()
        shard_servers[1].process.wait(10)
        killed_at = len(accepted)
        wait_until(lambda: len(accepted) >= killed_at + 30, 90, what="jobs after the kill")
        stop.set()
        for future in clients:
            future.result()
    ends = {job_id: stack.wait_terminal(job_id, timeout_s=90) for job_id in accepted}  # none stays pending
    plane_count = len(shard_servers)
    by_code = collections.Counter((doc["status"], (doc.get("error") or {}).get("code")) for doc in ends.values())
    for job_id, doc in ends.items():
        if shard_of(job_id, plane_count) != 1:
            assert doc["status"] == "succeeded", (job_id, doc, by_code)
        else:
            assert doc["status"] == "succeeded" or doc["error"]["code"] in {"shard_unavailable", "shard_lost"}, doc
    print(
        f"accepted {len(accepted)} (at the kill {killed_at}), refused {collections.Counter(refused)}, "
        f"ends {dict(by_code)}"
    )  # the figures docs/reliability.md quotes (pytest -s)
    after = accepted[killed_at + 5 :]
    assert all(shard_of(job_id, plane_count) != 1 for job_id in after)  # new jobs went to the live shards
    assert set(refused) <= {503} and len(refused) <= 8, refused  # only the few that met the dead shard
    # It comes back (empty: no persistence here): within its retry, new jobs are placed on it again and succeed.
    shard_servers[1].start()
    api_plane = api_services(stack.api.app).store.bulk
    wait_until(lambda: api_plane.is_up(1), 10, what="the API to try the shard again (past bulk.retry_s)")
    # Ids are random: a third land on shard 1, so submit until one does ((2/3)^40 of never: none at all).
    back: list[str] = []
    while not any(shard_of(job_id, plane_count) == 1 for job_id in back):
        back.append(stack.submit_ok(image))
        assert len(back) < 40, "no new job was placed on the shard that came back"
    assert all(stack.wait_terminal(job_id)["status"] == "succeeded" for job_id in back)


def test_over_bulk_shards_a_keys_upload_bytes_leave_its_count_at_the_push_too(redis_client, plane):
    """The control plane's verdict on a sharded push moves the key's count as the model's (contract.admission.budget):
    its upload's bytes leave it, whether the frame stands queued or was in a batch already."""
    from contract.admission.budget import WaitingBytes

    keys = Keys("sharded-keys")
    store = JobIntake(redis_client, keys, 600, bulk=plane)
    handoff = JobHandOff(redis_client, keys, 600, bulk=plane)
    pusher = frame_pusher(redis_client, keys, plane)
    counters = WaitingBytes(redis_client, keys)
    for index, running in ((1, False), (2, True)):
        verdict = counters.admit(MODEL, 1000, 10, 10**6, 10**6, owner="a", max_owner_model_bytes=10**5)
        assert verdict.verdict == "admitted" and counters.waiting("a")[MODEL] == 1000
        job_id = _job_on(plane, index)
        fields = {"model": MODEL, "bytes": 1000, "deadline_at": time.time() + 60, "owner": "a"}
        store.create(job_id, b"u" * 1000, 600, fields, reserved=1000)
        assert handoff.claim_for_preprocessing(job_id, time.time(), "c1")[0] == "claimed"
        if running:  # a GPU worker took its frame before the verdict ran
            redis_client.hset(keys.job(job_id), "status", RUNNING)
        assert pusher.push(job_id, MODEL, b"F" * 300, 64, {"pushed_at": 1.0}, "c1") == frames.PUSHED
        assert counters.waiting("a")[MODEL] == 0, running


def test_the_upload_marker_a_record_field_gives_its_bytes_back_once_however_the_job_goes(redis_client, plane):
    """The control plane's marker of a sharded upload is a field of the record (contract.redis.shards.UPLOAD_FIELD): the
    first step to take it gives the upload's bytes back, and no later one does: a job ended before its push (its
    late push finds it over), a push made again by a redelivered task, a worker's end of a job already pushed, and a
    record an older API stored with a marker key instead."""
    keys = Keys("sharded-marker")
    store = JobIntake(redis_client, keys, 600, bulk=plane)
    handoff = JobHandOff(redis_client, keys, 600, bulk=plane)
    pusher = frame_pusher(redis_client, keys, plane)

    def waiting() -> int:
        return int(redis_client.hget(keys.waiting_bytes, MODEL) or 0)

    # ended before its push (a sweep, a cancellation): the end gives the bytes back; the late push stands not
    redis_client.hset(keys.waiting_bytes, MODEL, 1000)
    job_id = _stored_job(store, plane, 1)
    assert handoff.claim_for_preprocessing(job_id, time.time(), "c1")[0] == "claimed"
    assert store.expire(job_id, "in a test") and waiting() == 0
    assert redis_client.hget(keys.job(job_id), UPLOAD_FIELD) == b""
    assert pusher.push(job_id, MODEL, b"F" * 300, 64, {"pushed_at": 1.0}, "c1") == frames.JOB_OVER
    assert waiting() == 0 and not plane.clients[1].llen(keys.frames(MODEL))

    # pushed, then a redelivered task's push (its claim the latest) and the job's end: the bytes traded once
    redis_client.hset(keys.waiting_bytes, MODEL, 1000)
    job_id = _stored_job(store, plane, 2)
    assert handoff.claim_for_preprocessing(job_id, time.time(), "c1")[0] == "claimed"
    assert pusher.push(job_id, MODEL, b"F" * 300, 64, {"pushed_at": 1.0}, "c1") == frames.PUSHED
    assert waiting() == 300  # the upload's 1000 traded for the frame's 300
    redis_client.hset(keys.job(job_id), "status", "preprocessing")  # as a redelivery's claim would leave it
    assert pusher.push(job_id, MODEL, b"G" * 300, 64, {"pushed_at": 2.0}, "c1") == frames.JOB_OVER  # marker taken
    assert waiting() == 300
    redis_client.hset(keys.job(job_id), "status", QUEUED_GPU)
    assert store.expire(job_id, "in a test") and waiting() == 300  # the frame's bytes are the batch write's

    # a record an older API stored: its marker a key of its own, which the push still takes
    redis_client.hset(keys.waiting_bytes, MODEL, 1000)
    job_id = _stored_job(store, plane, 0)
    redis_client.hdel(keys.job(job_id), UPLOAD_FIELD)
    redis_client.set(keys.upload(job_id), SHARDED_UPLOAD, ex=600)
    assert handoff.claim_for_preprocessing(job_id, time.time(), "c1")[0] == "claimed"
    assert pusher.push(job_id, MODEL, b"F" * 300, 64, {"pushed_at": 1.0}, "c1") == frames.PUSHED
    assert waiting() == 300 and not redis_client.exists(keys.upload(job_id))
