"""The shared contract: frames, settings, time bill, job records (real Redis)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import warnings

import pytest
import redis
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from contract.documents import job_document
from contract.frames import FrameError, FrameHeader, pack_frame, read_job_id, unpack_frame
from contract.frames import frame_push as frames
from contract.frames.frame_shards import frame_pusher
from contract.jobs.ending import JobEnding
from contract.jobs.handoff import CLAIM_FIELDS, JobHandOff
from contract.jobs.intake import JobIntake
from contract.jobs.record import (
    CANCELLED,
    EXPIRED,
    FAILED,
    MOVED,
    PREPROCESSING,
    QUEUED,
    QUEUED_GPU,
    RUNNING,
    SUCCEEDED,
    JobStore,
)
from contract.jobs.timebill import STAGES, compute_time_bill
from contract.redis.keys import Keys
from contract.settings.config import load_settings
from contract.settings.sections import SettingsError
from tests.support import REPO_ROOT, wait_until


def header(**overrides) -> FrameHeader:
    values = dict(
        job_id="j1",
        width=4,
        height=2,
        pad_left=0,
        pad_top=1,
        scale_x=0.5,
        scale_y=0.5,
        orig_width=8,
        orig_height=4,
        deadline_at=2.0,
        options={"conf": 0.3},
        stamps={"received_at": 0.5, "pushed_at": 1.0},
    )
    return FrameHeader(**{**values, **overrides})


def test_frame_round_trip_keeps_header_and_pixels():
    pixels = bytes(range(24))
    frame = unpack_frame(pack_frame(header(), pixels))
    assert frame.header == header()
    assert bytes(frame.pixels) == pixels
    assert frame.header.pushed_at == 1.0  # the time bill's stamp: the header has no second copy of it


def test_a_frame_an_earlier_version_pushed_is_read_with_its_enqueued_at_as_the_pushed_stamp():
    """Frames pushed before the header lost `enqueued_at` (issue 63, item 7) still wait in a list after an upgrade:
    read, with it as `pushed_at` (their stamps, when they carried one already, win)."""
    import json
    import struct

    fields = {**vars(header(stamps={"received_at": 0.5})), "enqueued_at": 7.0}
    encoded = json.dumps(fields).encode()
    old = struct.pack(">4sI", b"IMF1", len(encoded)) + encoded + bytes(24)
    assert unpack_frame(old).header.pushed_at == 7.0


def test_a_frame_header_may_grow_and_one_that_lacks_a_field_names_both_releases():
    """docs/upgrading.md's rule for the frame: a field a later release adds is dropped by this reader; a field
    this release needs, missing, is an error naming the writer's release and this one's (the job then ends
    `failed` with it: gpu_worker.feeder)."""
    import json
    import struct

    from contract.frames import FrameError
    from contract.runtime.release import RELEASE

    def framed(fields: dict) -> bytes:
        encoded = json.dumps(fields).encode()
        return struct.pack(">4sI", b"IMF1", len(encoded)) + encoded + bytes(24)

    packed = pack_frame(header(), bytes(24))
    written = json.loads(packed[8 : 8 + struct.unpack_from(">4sI", packed)[1]])
    assert written["release"] == RELEASE and written["enqueued_at"] == 1.0  # for readers of the release before
    grown = {**vars(header()), "release": "9.9.9", "priority": 3}
    assert unpack_frame(framed(grown)).header == header()
    lacking = {name: value for name, value in vars(header()).items() if name != "orig_width"}
    with pytest.raises(FrameError, match=f"written by 9.9.9, read by {RELEASE}"):
        unpack_frame(framed({**lacking, "release": "9.9.9"}))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda raw: raw[:3],  # shorter than the prefix
        lambda raw: b"XXXX" + raw[4:],  # bad magic
        lambda raw: raw[:-1],  # pixels missing
        lambda raw: raw[:8] + b"[" + raw[9:],  # header not JSON
        lambda raw: raw[:4] + b"\xff\xff\xff\xff" + raw[8:],  # absurd header length
    ],
)
def test_damaged_frames_raise_frame_error(mutate):
    raw = pack_frame(header(), bytes(24))
    with pytest.raises(FrameError):
        unpack_frame(mutate(raw))


def test_pack_refuses_pixels_that_do_not_match_the_header():
    with pytest.raises(FrameError):
        pack_frame(header(), bytes(23))


def test_job_id_can_be_read_from_a_frame_with_damaged_pixels():
    raw = pack_frame(header(job_id="abc"), bytes(24))
    assert read_job_id(raw[:-5]) == "abc"
    assert read_job_id(b"junk") is None


def test_time_bill_has_every_stage_from_the_stamps():
    stamps = {
        "received_at": 10.0,
        "submitted_at": 10.002,
        "cpu_started_at": 10.010,
        "decode_ms": 5.0,
        "resize_ms": 2.0,
        "backpressure_ms": 0.0,
        "pushed_at": 10.020,
        "popped_at": 10.030,
        "batch_closed_at": 10.042,
        "device_started_at": 10.050,
        "infer_ms": 70.0,
        "postprocess_ms": 3.0,
        "finished_at": 10.200,
    }
    bill = compute_time_bill(stamps)
    assert list(bill) == list(STAGES)
    assert bill["receive"] == pytest.approx(2.0) and bill["queue_gpu"] == pytest.approx(10.0)
    assert bill["batch_wait"] == pytest.approx(12.0) and bill["device_queue"] == pytest.approx(8.0)
    assert bill["total"] == pytest.approx(200.0)


def test_time_bill_leaves_out_stages_without_stamps():
    assert compute_time_bill({"received_at": 1.0, "submitted_at": 1.5}) == {"receive": 500.0}


def test_default_settings_match_the_story():
    settings = load_settings()
    assert settings.batching.max_batch_size == 8 and settings.batching.window_ms == 12
    assert settings.model.name == "shapes-yolo" and settings.model.input_size == 320


def test_overlay_settings_and_env_redis_url(tmp_path, monkeypatch):
    overlay = tmp_path / "mine.yaml"
    overlay.write_text("batching: {window_ms: 5}\nnamespace: other\n")
    monkeypatch.setenv("IMGSERVE_REDIS_URL", "redis://example:1/2")
    settings = load_settings(overlay)
    assert settings.batching.window_ms == 5 and settings.batching.max_batch_size == 8
    assert settings.namespace == "other" and settings.redis_url == "redis://example:1/2"


def test_a_latency_profile_in_a_file_replaces_the_default_table_whole(tmp_path, monkeypatch):
    overlay = tmp_path / "fast.yaml"
    overlay.write_text("gpu_worker: {sim_latency_ms: {1: 2, 8: 6, 16: 10}}\n")
    settings = load_settings(overlay)
    assert settings.gpu_worker.sim_latency_ms == {1: 2.0, 8: 6.0, 16: 10.0}  # not the default's 4: 150 kept
    assert settings.gpu_worker.busy_window_s == 60  # the section's other settings still the defaults
    monkeypatch.setenv("IMGSERVE_GPU_WORKER__SIM_LATENCY_MS", '{"1": 3, "8": 9}')
    assert load_settings(overlay).gpu_worker.sim_latency_ms == {1: 3.0, 8: 9.0}


@pytest.mark.parametrize(
    "text",
    [
        "batching: {windw_ms: 5}\n",
        "model: {name: x, version: 1, labels: [], format: builtin}\n",
        "model: {name: x, version: 1, labels: [a], format: onnx}\n",
    ],
)
def test_bad_settings_are_refused_with_a_clear_error(tmp_path, text):
    overlay = tmp_path / "bad.yaml"
    overlay.write_text(text)
    with pytest.raises(SettingsError):
        load_settings(overlay)


def test_job_store_first_terminal_state_wins_and_is_published(redis_client):
    store = JobIntake(redis_client, Keys("t"), ttl_s=60)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(Keys("t").job_events)
    store.create("j", b"bytes", 60, {"received_at": 1.0, "deadline_at": 1e12, "options": {"conf": 0.5}})
    assert advance(store, "j", PREPROCESSING)
    assert store.finish("j", SUCCEEDED, {"result": {"detections": []}})
    assert not store.finish("j", FAILED, {"error": {"code": "x"}})
    assert not advance(store, "j", RUNNING)
    record = store.load("j")
    assert record["status"] == SUCCEEDED and record["result"] == {"detections": []}
    assert record["options"] == {"conf": 0.5} and "error" not in record
    message = wait_until(lambda: pubsub.get_message(timeout=0.1), 5, what="the job-end message")
    assert message["data"] == b"j"
    assert redis_client.ttl(Keys("t").job("j")) > 10**11  # until jobs.ttl_s past its (far) deadline


def test_a_record_lives_until_its_ttl_past_its_deadline_and_its_end_sets_no_ttl_again(redis_client):
    """A record stays readable jobs.ttl_s past its deadline, so at least that long after whatever ends it (the
    sweeper ends it at the deadline at the latest); a record without a deadline gets its TTL at its end."""
    keys = Keys("record-ttl")
    store = JobIntake(redis_client, keys, ttl_s=600)
    now = time.time()
    store.create("soon", b"u", 60, {"deadline_at": now + 30})
    store.create("bare", b"u", 60, {})
    assert 600 + 29 <= redis_client.ttl(keys.job("soon")) <= 600 + 31
    redis_client.expire(keys.job("bare"), 5)  # as a record of another writer might have it
    assert store.finish("soon", SUCCEEDED, {"result": {"detections": []}})
    assert store.finish("bare", SUCCEEDED, {"result": {"detections": []}})
    assert 600 + 29 <= redis_client.ttl(keys.job("soon")) <= 600 + 31  # the end left it as it was
    assert 590 <= redis_client.ttl(keys.job("bare")) <= 600


def test_an_answer_after_the_deadline_does_not_stand_and_the_sweeper_ends_what_nobody_ended(redis_client):
    keys = Keys("late")
    store = JobIntake(redis_client, keys, ttl_s=60)
    now = time.time()
    store.create("late", b"upload", 60, {"received_at": now - 2, "deadline_at": now - 0.5})
    store.create("soon", b"upload", 60, {"received_at": now, "deadline_at": now + 0.3})
    store.create("later", b"upload", 60, {"received_at": now, "deadline_at": now + 60})
    assert redis_client.zcard(keys.deadlines) == 3
    assert store.finish("late", SUCCEEDED, {"result": {"detections": []}, "timings": {"total": 2000.0}})
    late = store.load("late")
    assert late["status"] == EXPIRED and "result" not in late and late["error"]["code"] == "deadline"
    assert late["timings"] == {"total": 2000.0}  # the time bill still says where the time went
    assert store.expire_overdue(now) == 0  # it ended: no longer in the index
    assert store.expire_overdue(now + 1.0) == 1  # `soon` is past its deadline: it ends
    soon = store.load("soon")
    assert soon["status"] == EXPIRED and soon["error"]["message"] == "expired before an answer was written"
    assert not redis_client.exists(keys.upload("soon"))
    assert redis_client.zrange(keys.deadlines, 0, -1) == [b"later"]
    assert store.finish("later", SUCCEEDED, {"result": {"detections": []}})  # on time: it stands
    assert store.load("later")["status"] == SUCCEEDED and redis_client.zcard(keys.deadlines) == 0
    redis_client.zadd(keys.deadlines, {"gone": now - 10})  # a job whose record expired meanwhile
    assert store.expire_overdue(now) == 0 and redis_client.zcard(keys.deadlines) == 0


@pytest.mark.parametrize("status", [FAILED, EXPIRED, CANCELLED, SUCCEEDED])
def test_whatever_ends_a_job_deletes_its_upload_in_the_same_step(redis_client, status):
    store = JobIntake(redis_client, Keys("t"), ttl_s=60)
    store.create("u", b"twenty MiB, say", 600, {"received_at": 1.0, "deadline_at": 1e12})
    assert redis_client.exists(Keys("t").upload("u"))
    assert store.finish("u", status, {"error": {"code": "x", "message": "y"}})
    assert not redis_client.exists(Keys("t").upload("u")) and redis_client.exists(Keys("t").job("u"))


def test_unknown_jobs_cannot_be_moved(redis_client):
    store = JobEnding(redis_client, Keys("t"), ttl_s=60)
    assert not advance(store, "nope", RUNNING)
    assert not store.finish("nope", CANCELLED)
    assert store.load("nope") is None


def test_job_document_shape():
    doc = job_document({"id": "j", "status": "queued", "received_at": 0.0, "options": {}})
    assert list(doc) == ["id", "status", "created_at", "options", "result", "error", "timings_ms", "batch"]
    assert doc["created_at"] == "1970-01-01T00:00:00.000Z"
    json.dumps(doc)


def test_cpu_worker_never_imports_torch():
    code = "import sys, tasks.worker; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@hypothesis_settings(max_examples=300)
@given(st.binary(max_size=200))
def test_no_bytes_make_frame_unpacking_raise_anything_but_frame_error(data):
    for candidate in (data, b"IMF1" + data, pack_frame(header(), bytes(24))[:12] + data):
        try:
            unpack_frame(candidate)
        except FrameError:
            pass


@given(
    st.dictionaries(
        st.sampled_from(["job_id", "width", "height", "pad_left", "dtype", "scale_x"]),
        st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none(), st.floats()),
    )
)
def test_no_header_contents_make_unpacking_raise_anything_but_frame_error(fields):
    import json as _json
    import struct as _struct

    body = _json.dumps({**dataclasses_asdict(header()), **fields}).encode()
    raw = _struct.pack(">4sI", b"IMF1", len(body)) + body + bytes(24)
    try:
        unpack_frame(raw)
    except FrameError:
        pass


def dataclasses_asdict(value):
    import dataclasses

    return dataclasses.asdict(value)


def test_large_values_go_to_redis_uncopied_and_arrive_whole(redis_server):
    """A big value leaves as a chunk of its own, not copied into the command's buffer, and arrives whole;
    a many-argument command is one buffer packed by hiredis."""
    import dataclasses

    from contract.redis.connection import COMMAND_PACKER, connect
    from contract.settings.config import load_settings

    client = connect(dataclasses.replace(load_settings(), redis_url=redis_server.url))
    value = bytes(range(256)) * 4000  # 1 MB, every byte value
    client.set("itest:big", value)
    assert client.get("itest:big") == value
    assert client.connection_pool.connection_kwargs["command_packer"] is COMMAND_PACKER
    assert any(chunk is value for chunk in COMMAND_PACKER.pack("SETEX", "itest:big", 60, value))
    assert len(COMMAND_PACKER.pack("EVALSHA", "f" * 40, 2, "k1", "k2", *range(50))) == 1
    client.delete("itest:big")


def test_a_bounded_pool_closes_the_connections_a_burst_left_idle(redis_server):
    """An API process held every connection a burst opened for the rest of its life (issue 41: 19 -> 26
    descriptors per gunicorn worker). Connections idle past the limit close; the pool stays usable, bounded."""
    from contract.redis.connection import IdleClosingPool

    now = [1000.0]
    pool = IdleClosingPool.from_url(redis_server.url, max_connections=6, timeout=0.5, clock=lambda: now[0])
    observer = redis.Redis.from_url(redis_server.url)
    before = len(observer.client_list())
    burst = [pool.get_connection() for _ in range(5)]  # five round trips at once: five connections
    for connection in burst:
        connection.send_command("PING")
        assert connection.read_response() in (b"PONG", "PONG")
    assert len(observer.client_list()) == before + 5
    for index, connection in enumerate(burst):  # back to the pool 0, 10, ..., 40 s from now
        now[0] = 1000.0 + 10 * index
        pool.release(connection)
    now[0] = 1000.0 + 40 + 25  # idle 65, 55, 45, 35 and 25 s
    assert pool.close_idle(50.0) == 2
    wait_until(lambda: len(observer.client_list()) == before + 3, 5, what="Redis to see two connections close")
    assert pool.close_idle(50.0) == 0  # a closed one is not closed again
    assert redis.Redis(connection_pool=pool).ping()  # the pool still serves
    held = [pool.get_connection() for _ in range(6)]  # the two closed ones reconnect to make up six
    with pytest.raises(redis.ConnectionError):  # bounded: a seventh waits, then gives up
        pool.get_connection()
    for connection in held:
        pool.release(connection)
    pool.disconnect()
    observer.close()


_ARGUMENT = st.one_of(
    st.text(max_size=20),
    st.binary(max_size=20),
    st.integers(),
    st.floats(allow_nan=False),
    st.binary(min_size=6001, max_size=7000).map(memoryview),
)


@given(st.sampled_from(["SET", "EVALSHA", b"HSET", "SCRIPT LOAD", b"CLIENT SETNAME"]), st.lists(_ARGUMENT, max_size=12))
def test_the_command_packer_writes_what_redis_pys_own_writes(command, arguments):
    """Byte for byte what redis-py's packer sends (floats as repr, ints, text as UTF-8, words of a command
    split), only faster; what redis-py refuses is refused too."""
    from redis.connection import PythonRespSerializer

    from contract.redis.connection import COMMAND_PACKER

    def wire(chunks):
        return b"".join(bytes(chunk) for chunk in chunks)

    reference = PythonRespSerializer(6000, redis.connection.Encoder("utf-8", "strict", False).encode)
    assert wire(COMMAND_PACKER.pack(command, *arguments)) == wire(reference.pack(command, *arguments))


@pytest.mark.parametrize("refused", [None, True, bytearray(b"x")])
def test_the_command_packer_refuses_what_redis_py_refuses(refused):
    from contract.redis.connection import COMMAND_PACKER

    with pytest.raises(redis.DataError):
        COMMAND_PACKER.pack("SET", "k", refused)


def test_a_redelivered_preprocess_task_cannot_push_a_second_frame(redis_client):
    """Two deliveries of one task both decoded the image: only the first push lands (the check is in
    the Lua step, not in Python before it)."""
    keys = Keys("redeliver")
    store = JobIntake(redis_client, keys, ttl_s=60)
    pusher = frame_pusher(redis_client, keys)
    store.create("a" * 32, b"upload", 60, {"deadline_at": 1e12})
    assert advance(store, "a" * 32, PREPROCESSING)
    first = pusher.push("a" * 32, "m:1", b"frame", 10, {"pushed_at": 1.0})
    second = pusher.push("a" * 32, "m:1", b"frame", 10, {"pushed_at": 2.0})
    assert (first, second) == (frames.PUSHED, frames.JOB_OVER)
    assert redis_client.llen(keys.frames("m:1")) == 1
    assert store.load("a" * 32)["pushed_at"] == 1.0


def test_a_frame_is_not_pushed_for_a_job_not_yet_claimed_or_without_its_upload(redis_client):
    keys = Keys("unclaimed")
    store = JobIntake(redis_client, keys, ttl_s=60)
    pusher = frame_pusher(redis_client, keys)
    store.create("b" * 32, b"upload", 60, {"deadline_at": 1e12})  # still queued: not claimed
    assert pusher.push("b" * 32, "m:1", b"frame", 10, {}) == frames.JOB_OVER
    assert advance(store, "b" * 32, PREPROCESSING)
    redis_client.delete(keys.upload("b" * 32))  # the upload expired
    assert pusher.push("b" * 32, "m:1", b"frame", 10, {}) == frames.JOB_OVER
    assert redis_client.llen(keys.frames("m:1")) == 0


def test_only_the_latest_claim_may_push_the_frame(redis_client):
    """A worker presumed dead (its task given back and claimed again) may still be running: its push is voided."""
    keys = Keys("fenced")
    store = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60)
    pusher = frame_pusher(redis_client, keys)
    store.create("e" * 32, b"upload", 60, {"deadline_at": 1e12})
    assert handoff.claim_for_preprocessing("e" * 32, time.time(), "first")[0] == "claimed"
    assert handoff.claim_for_preprocessing("e" * 32, time.time(), "second")[0] == "claimed"  # the redelivery
    assert pusher.push("e" * 32, "m:1", b"stale", 10, {}, "first") == frames.JOB_OVER
    assert redis_client.llen(keys.frames("m:1")) == 0 and redis_client.exists(keys.upload("e" * 32))
    assert pusher.push("e" * 32, "m:1", b"frame", 10, {}, "second") == frames.PUSHED
    assert redis_client.lrange(keys.frames("m:1"), 0, -1) == [b"frame"]


def test_a_claim_found_late_or_failed_is_ended_by_the_hand_off_and_its_upload_goes(redis_client):
    """The claim's own ends (JobHandOff.expire_late, fail): the job ends with where or why, once (the first end
    wins), and its upload goes with it."""
    keys = Keys("claim-ends")
    store = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60)
    store.create("a" * 32, b"upload", 60, {"deadline_at": time.time() - 1})
    assert handoff.claim_for_preprocessing("a" * 32, time.time())[0] == "late"
    assert handoff.expire_late("a" * 32) and not handoff.expire_late("a" * 32)
    late = store.load("a" * 32)
    assert late["status"] == EXPIRED and late["error"]["message"] == "expired before preprocessing", late
    store.create("b" * 32, b"upload", 60, {"deadline_at": 1e12})
    assert handoff.claim_for_preprocessing("b" * 32, time.time())[0] == "claimed"
    assert handoff.fail("b" * 32, "decode_error", "not an image") and not handoff.fail("b" * 32, "again", "no")
    failed = store.load("b" * 32)
    assert failed["status"] == FAILED and failed["error"] == {"code": "decode_error", "message": "not an image"}
    assert not redis_client.exists(keys.upload("a" * 32), keys.upload("b" * 32))
    assert redis_client.zcard(keys.deadlines) == 0


def advance(store: JobStore, job_id: str, status: str) -> bool:
    """Move a live job to a non-terminal status; False when it is gone or already over."""
    return bool(store.advance_many([job_id], status, 0)[0] == MOVED)


def test_any_setting_comes_from_the_environment_by_one_rule(monkeypatch):
    monkeypatch.setenv("IMGSERVE_GPU_WORKER__DEVICE", "sim")
    monkeypatch.setenv("IMGSERVE_BATCHING__WINDOW_MS", "8.5")
    monkeypatch.setenv("IMGSERVE_CALLBACKS__ALLOW_HOSTS", "[10.0.0.0/8, hooks.internal]")
    settings = load_settings()
    assert settings.gpu_worker.device == "sim" and settings.batching.window_ms == 8.5
    assert tuple(settings.callbacks.allow_hosts) == ("10.0.0.0/8", "hooks.internal")


def test_every_section_of_the_settings_takes_the_environment(monkeypatch):
    """IMGSERVE_CACHE__ENABLED was refused ("no settings section 'cache'"): the environment's map of sections had
    missed it, though configuration.md says any setting can be set so. Each section's first setting, set to its
    own default through the environment, loads."""
    import dataclasses

    import yaml

    from contract.settings import Settings

    sections = [f for f in dataclasses.fields(Settings) if f.default_factory is not dataclasses.MISSING]
    assert {"cache", "scaling", "celery", "bulk", "redis"} <= {f.name for f in sections}
    for section in sections:
        default = section.default_factory()
        first = dataclasses.fields(default)[0]
        value = getattr(default, first.name)
        text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True)
        monkeypatch.setenv(f"IMGSERVE_{section.name.upper()}__{first.name.upper()}", text.strip().removesuffix("..."))
    settings = load_settings()
    for section in sections:
        first = dataclasses.fields(section.default_factory())[0]
        assert getattr(getattr(settings, section.name), first.name) == getattr(section.default_factory(), first.name)


def test_the_servers_and_logs_settings_follow_the_rule_and_0_1_0s_names_are_refused_naming_the_new_one(monkeypatch):
    from contract.runtime.logs import configure_logging
    from contract.settings.config import RENAMED_ENV

    monkeypatch.setenv("IMGSERVE_API__WORKERS", "5")
    monkeypatch.setenv("IMGSERVE_API__BIND", "127.0.0.1:9")
    monkeypatch.setenv("IMGSERVE_LOGS__LEVEL", "warning")
    settings = load_settings()
    assert (settings.api.workers, settings.api.bind, settings.logs.level) == (5, "127.0.0.1:9", "warning")
    monkeypatch.setenv("IMGSERVE_API_WORKERS", "3")  # 0.1.0's name: no longer read, and said so
    with pytest.raises(SettingsError, match="IMGSERVE_API_WORKERS is 0.1.0's name.*set IMGSERVE_API__WORKERS"):
        load_settings()
    monkeypatch.delenv("IMGSERVE_API_WORKERS")
    monkeypatch.delenv("IMGSERVE_LOGS__LEVEL")
    monkeypatch.setenv("IMGSERVE_LOG_LEVEL", "warning")
    with pytest.raises(SettingsError, match="IMGSERVE_LOG_LEVEL is 0.1.0's name.*set IMGSERVE_LOGS__LEVEL"):
        load_settings()
    configure_logging("test")  # before any settings: the environment alone, the old name not read
    assert logging.getLogger().level == logging.INFO  # the default
    configure_logging("test", settings.logs)
    assert set(RENAMED_ENV.values()) <= {
        f"IMGSERVE_{section.upper()}__{key.upper()}" for section in ("api", "logs") for key in _fields_of(section)
    }


def _fields_of(section: str) -> list[str]:
    import dataclasses

    from contract import settings as settings_module

    owner = {"api": settings_module.ApiSettings, "logs": settings_module.LogSettings}[section]
    return [f.name for f in dataclasses.fields(owner)]


@pytest.mark.parametrize(
    "name, says",
    [
        ("IMGSERVE_BATCHING__WINDOW_MZ", "unknown BatchingSettings settings"),
        ("IMGSERVE_NOPE__X", "no settings section 'nope'"),
        ("IMGSERVE_MODEL__CONF", "no settings section 'model'"),
    ],
)
def test_a_misspelt_environment_setting_is_refused_by_name(monkeypatch, name, says):
    monkeypatch.setenv(name, "1")
    with pytest.raises(SettingsError, match=says):
        load_settings()


def test_the_default_file_names_every_setting_the_code_has_with_the_same_default():
    """configs/default.yaml is where a reader looks for a setting: every field of Settings and every field of each of
    its sections is there, with the value the code falls back to, so the two places cannot drift apart. The list
    is Settings' own fields: a section added to the code is checked without being named here."""
    import dataclasses
    import typing

    import yaml

    from contract.settings import Settings

    text = (REPO_ROOT / "configs" / "default.yaml").read_text()
    written = yaml.safe_load(text)
    types = typing.get_type_hints(Settings)
    sections = 0
    for top in dataclasses.fields(Settings):
        if top.name in ("model", "models"):  # a spec file, or a list of them instead: one or the other
            assert "model" in written and "\n# models:" in text, top.name
            continue
        assert top.name in written, f"configs/default.yaml lacks {top.name}"
        cls = types[top.name]
        if not dataclasses.is_dataclass(cls):  # a plain setting (redis_url, namespace), or a list of them (cells)
            value = written[top.name]
            assert (tuple(value) if isinstance(value, list) else value) == top.default, top.name
            continue
        sections += 1
        missing = {f.name for f in dataclasses.fields(cls)} - set(written[top.name] or {})
        assert not missing, f"configs/default.yaml lacks {top.name}: {sorted(missing)}"
        for field in dataclasses.fields(cls):  # and says what the code does when a file is silent
            in_code, in_file = getattr(cls(), field.name), written[top.name][field.name]
            if isinstance(in_code, dict):
                in_code, in_file = ({float(k): float(v) for k, v in d.items()} for d in (in_code, in_file))
            assert (tuple(in_file) if isinstance(in_file, list) else in_file) == in_code, (top.name, field.name)
    assert sections >= 14  # the sections of today (routing, redis, api .. bulk): the walk found them


def test_a_cpu_worker_claims_a_job_in_one_step(redis_client):
    keys = Keys("claim")
    store = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60)
    assert handoff.claim_for_preprocessing("c" * 32, 100.0)[0] == "missing"
    store.create(
        "c" * 32,
        b"the upload",
        60,
        {"deadline_at": 200.0, "received_at": 99.0, "model": "m:1", "options": {"conf": 0.5}, "owner": "k"},
    )
    assert handoff.claim_for_preprocessing("c" * 32, 201.0)[:2] == ("late", None)
    assert store.load("c" * 32)["status"] == QUEUED  # the caller ends it
    verdict, upload, record, _ = handoff.claim_for_preprocessing("c" * 32, 150.0)
    assert (verdict, upload) == ("claimed", b"the upload")
    # the fields the worker reads, and only those the record has (no decode_cost, no submitted_at here)
    assert record == {
        "status": PREPROCESSING,
        "model": "m:1",
        "deadline_at": 200.0,
        "options": {"conf": 0.5},
        "received_at": 99.0,
        "owner": "k",
    }
    assert store.load("c" * 32)["cpu_started_at"] == 150.0
    assert handoff.claim_for_preprocessing("c" * 32, 151.0)[0] == "claimed"  # a redelivery may claim again
    store.finish("c" * 32, CANCELLED)
    verdict, upload, record, _ = handoff.claim_for_preprocessing("c" * 32, 152.0)
    assert (verdict, upload, record["status"]) == ("over", None, CANCELLED)
    store.create("d" * 32, b"x", 60, {"deadline_at": 200.0})
    redis_client.delete(keys.upload("d" * 32))
    assert handoff.claim_for_preprocessing("d" * 32, 150.0)[:2] == ("claimed", None)  # the caller fails it
    redis_client.script_flush()  # Redis forgot the script
    assert handoff.claim_for_preprocessing("d" * 32, 151.0)[0] == "claimed"
    redis_client.script_flush()
    redis_client.client_kill_filter(_type="normal", skipme=True)  # and dropped the claim's connection (a restart)
    assert handoff.claim_for_preprocessing("d" * 32, 152.0)[0] == "claimed"


def test_the_claim_reads_what_the_worker_uses_of_a_record_however_the_job_stands(redis_client):
    """The claim reads CLAIM_FIELDS, not the whole record: a key's decode share (given back whatever the verdict),
    the submission's stamps, and how a job ended when a late redelivery finds it over."""
    keys = Keys("claim-fields")
    store = JobIntake(redis_client, keys, ttl_s=60)
    handoff = JobHandOff(redis_client, keys, ttl_s=60)
    fields = {"deadline_at": 1e12, "received_at": 1.0, "submitted_at": 2.0, "model": "m:1", "decode_cost": "4096"}
    store.create("f" * 32, b"upload", 60, {**fields, "callback_url": "http://127.0.0.1:5000/", "media_type": "x"})
    verdict, _, record, _ = handoff.claim_for_preprocessing("f" * 32, 3.0, "first")
    assert verdict == "claimed" and set(record) == {"status", *fields} <= set(CLAIM_FIELDS)
    assert record["decode_cost"] == "4096" and record["submitted_at"] == 2.0
    assert handoff.expire("f" * 32, "a sweep, while the first attempt decoded")  # the job ends under the worker
    verdict, upload, record, _ = handoff.claim_for_preprocessing("f" * 32, 4.0, "second")  # a redelivered task
    assert (verdict, upload, record["status"], record["decode_cost"]) == ("over", None, EXPIRED, "4096")


def test_a_config_naming_the_decode_limits_under_api_as_0_1_0_did_is_refused(tmp_path):
    (tmp_path / "old.yaml").write_text("api:\n  max_image_pixels: 1000\n  max_upload_bytes: 5000\n")
    with pytest.raises(SettingsError, match="unknown ApiSettings settings: max_image_pixels"):
        load_settings(tmp_path / "old.yaml")
    (tmp_path / "new.yaml").write_text("decode:\n  max_image_pixels: 1000\napi:\n  max_upload_bytes: 5000\n")
    settings = load_settings(tmp_path / "new.yaml")
    assert settings.decode.max_image_pixels == 1000 and settings.api.max_upload_bytes == 5000
    assert not hasattr(settings.api, "max_image_pixels")


def test_a_setting_of_the_wrong_type_is_refused_by_name_and_a_clear_one_coerced(tmp_path):
    (tmp_path / "typed.yaml").write_text("batching:\n  max_batch_size: '16'\n  window_ms: 8\n")
    settings = load_settings(tmp_path / "typed.yaml")
    assert settings.batching.max_batch_size == 16 and isinstance(settings.batching.window_ms, float)
    (tmp_path / "wrong.yaml").write_text("batching:\n  window_ms: soon\n")
    with pytest.raises(SettingsError, match="BatchingSettings: window_ms: .*number"):
        load_settings(tmp_path / "wrong.yaml")


def test_a_frame_for_a_full_list_leaves_the_list_and_the_job_as_they_were(redis_client):
    """The frame is pushed, then checked in the same transaction: over the bound it goes again, and
    the frames already queued keep their order."""
    keys = Keys("fulllist")
    store = JobIntake(redis_client, keys, ttl_s=60)
    pusher = frame_pusher(redis_client, keys)
    store.create("c" * 32, b"upload", 60, {"deadline_at": 1e12})
    assert advance(store, "c" * 32, PREPROCESSING)
    redis_client.lpush(keys.frames("m:1"), b"older", b"newer")
    assert not pusher.has_room("c" * 32, "m:1", 2)
    assert pusher.push("c" * 32, "m:1", b"frame", 2, {"pushed_at": 1.0}) == frames.LIST_FULL
    assert redis_client.lrange(keys.frames("m:1"), 0, -1) == [b"newer", b"older"]
    assert store.load("c" * 32)["status"] == PREPROCESSING
    assert redis_client.exists(keys.upload("c" * 32))
    assert pusher.has_room("c" * 32, "m:1", 3)
    assert pusher.push("c" * 32, "m:1", b"frame", 3, {"pushed_at": 2.0}) == frames.PUSHED
    assert redis_client.lrange(keys.frames("m:1"), 0, -1) == [b"frame", b"newer", b"older"]
    assert store.load("c" * 32)["status"] == QUEUED_GPU and store.load("c" * 32)["pushed_at"] == 2.0
    assert not redis_client.exists(keys.upload("c" * 32))


def test_a_frame_for_a_job_that_ended_is_not_left_in_the_list(redis_client):
    keys = Keys("endedjob")
    store = JobIntake(redis_client, keys, ttl_s=60)
    pusher = frame_pusher(redis_client, keys)
    store.create("d" * 32, b"upload", 60, {"deadline_at": 1e12})
    assert advance(store, "d" * 32, PREPROCESSING)
    redis_client.lpush(keys.frames("m:1"), b"queued")
    assert store.fail("d" * 32, "cancelled", "ended by a test")
    assert pusher.push("d" * 32, "m:1", b"frame", 10, {}) == frames.JOB_OVER
    assert redis_client.lrange(keys.frames("m:1"), 0, -1) == [b"queued"]
    assert store.load("d" * 32)["status"] == FAILED


def test_a_key_share_that_with_the_frame_list_fills_a_models_backlog_is_warned_of(tmp_path):
    config = tmp_path / "keys.yaml"
    config.write_text(
        "auth:\n  api_keys:\n    - {id: team-a, sha256: " + "0" * 64 + "}\n"
        "backpressure: {max_backlog: 100, max_frames: 64}\n"
    )
    with pytest.warns(UserWarning, match=r"one API key's share of the backlog \(50\) and the frame list \(64\)"):
        load_settings(config)
    config.write_text(config.read_text().replace("max_backlog: 100", "max_backlog: 160"))  # 80 + 64 < 160
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_settings(config)


def test_a_key_byte_share_that_with_the_frame_list_fills_a_models_byte_budget_is_warned_of(tmp_path):
    """A key's byte share counts its uploads; the frame list behind them holds up to max_frames frames of the
    model's input size: the two together must stay under the budget, or one key's uploads can refuse the others."""
    config = tmp_path / "keys.yaml"
    config.write_text(
        "auth:\n  api_keys:\n    - {id: team-a, sha256: " + "0" * 64 + "}\n"
        "api: {max_upload_bytes: 1048576}\n"
        "backpressure: {max_waiting_bytes: 30000000, max_total_waiting_bytes: 90000000}\n"
    )
    # the default model's 320x320 frames: 64 of them are 19,660,800 bytes; with a share of 15,000,000, past 30 MB
    with pytest.warns(UserWarning, match=r"the frame list's largest frames \(19660800 bytes\) reach max_waiting"):
        load_settings(config)
    config.write_text(config.read_text().replace("max_waiting_bytes: 30000000", "max_waiting_bytes: 80000000"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_settings(config)
