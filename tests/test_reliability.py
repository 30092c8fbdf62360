"""Nothing lost: cancellation, crashes of real processes, poison frames,
backpressure and bad input. Real processes, real signals."""

from __future__ import annotations

import io
import math
import os
import signal
import subprocess
import threading
import time

import pytest
import yaml
from PIL import Image

from app.services import services as api_services
from bench.stack.processes import ManagedProcess, RedisServer, children_of, gpu_worker_argv
from contract.jobs.intake import JobIntake
from contract.jobs.record import EXPIRED, PREPROCESSING, QUEUED_GPU, TERMINAL
from tests.support import encode, jpeg, make_image, wait_until

pytestmark = pytest.mark.integration
TERMINAL = tuple(TERMINAL)


# --- cancellation -----------------------------------------------------------
def test_cancel_a_waiting_job_then_409_once_it_is_over(stack):
    stack.stop_gpu_worker()
    try:
        job_id = stack.submit_ok(jpeg(300, 200))
        wait_until(lambda: stack.job(job_id)["status"] == "queued_gpu", 30, what="the frame to be queued")
        response = stack.session.delete(stack.url(f"/v1/jobs/{job_id}"), timeout=10)
        assert response.status_code == 200 and response.json()["status"] == "cancelled"
    finally:
        stack.start_gpu_worker()
    wait_until(lambda: stack.redis.llen(stack.frames_key) == 0, 30, what="the frame to be drained")
    assert stack.job(job_id)["status"] == "cancelled"  # the GPU worker skipped it
    again = stack.session.delete(stack.url(f"/v1/jobs/{job_id}"), timeout=10)
    assert again.status_code == 409 and again.json()["type"] == "/problems/job-already-finished"
    assert stack.session.delete(stack.url("/v1/jobs/nope"), timeout=10).status_code == 404


# --- crashes ----------------------------------------------------------------
def test_frames_of_a_dead_gpu_worker_are_requeued_by_a_live_one(stack):
    """A worker that died holding frames: its heartbeat is gone, its processing list is not."""
    stack.stop_gpu_worker()
    try:
        ids = [stack.submit_ok(jpeg(320, 240, seed=i)) for i in range(3)]
        wait_until(lambda: stack.redis.llen(stack.frames_key) == 3, 30, what="three frames")
        dead = "dead-gpu"
        for _ in ids:
            stack.redis.lmove(stack.frames_key, stack.keys.processing(dead, stack.settings.model.key), "RIGHT", "LEFT")
        stack.redis.zadd(stack.keys.gpu_workers, {dead: time.time() - 3600})
    finally:
        stack.start_gpu_worker()
    docs = [stack.wait_terminal(job_id) for job_id in ids]
    assert [d["status"] for d in docs] == ["succeeded"] * 3
    assert stack.redis.llen(stack.keys.processing(dead, stack.settings.model.key)) == 0
    assert stack.redis.zscore(stack.keys.gpu_workers, dead) is None
    assert all(stack.redis.hget(stack.keys.job(j), "attempts") == b"1" for j in ids)


def test_a_frame_that_kept_killing_workers_fails_as_poison(stack):
    stack.stop_gpu_worker()
    try:
        job_id = stack.submit_ok(jpeg(320, 240))
        wait_until(lambda: stack.redis.llen(stack.frames_key) == 1, 30, what="the frame")
        stack.redis.hset(stack.keys.job(job_id), "attempts", stack.settings.gpu_worker.max_attempts)
    finally:
        stack.start_gpu_worker()
    doc = stack.wait_terminal(job_id)
    assert doc["status"] == "failed" and doc["error"]["code"] == "poison"
    assert stack.gpu_worker.alive()


def slow_sim_worker(stack, name: str, latency_ms: float = 1500, max_batch: int = 8) -> ManagedProcess:
    """A second GPU worker on the same list, simulated, 1.5 s per batch: easy to kill mid-batch."""
    config = yaml.safe_load(stack.config_path.read_text())
    config["gpu_worker"] = {**config.get("gpu_worker", {}), "sim_latency_ms": {1: latency_ms, 8: latency_ms}}
    config["batching"] = {**config.get("batching", {}), "max_batch_size": max_batch}
    path = stack.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**stack.env, "IMGSERVE_CONFIG": str(path)}
    worker = ManagedProcess(name, gpu_worker_argv("sim", name), env, stack.log_dir)
    wait_until(
        lambda: stack.redis.exists(stack.keys.heartbeat(name)) or not worker.alive(), 60, what=f"{name}'s heartbeat"
    )
    return worker


def test_sigkill_mid_batch_loses_nothing_and_answers_once(stack):
    stack.stop_gpu_worker()
    try:
        for attempt in range(2):  # killed twice, restarted twice
            worker = slow_sim_worker(stack, "killable-gpu")
            ids = [stack.submit_ok(jpeg(320, 240, seed=attempt * 10 + i)) for i in range(4)]
            held = stack.keys.processing("killable-gpu", stack.settings.model.key)
            wait_until(lambda: stack.redis.llen(held) > 0, 30, what="a batch in hand")
            worker.stop(signal.SIGKILL)
            assert stack.redis.llen(stack.keys.processing("killable-gpu", stack.settings.model.key)) > 0
            restarted = slow_sim_worker(stack, "killable-gpu")  # requeues its own frames first
            docs = [stack.wait_terminal(j, timeout_s=90) for j in ids]
            assert [d["status"] for d in docs] == ["succeeded"] * 4, docs
            assert stack.redis.llen(stack.keys.processing("killable-gpu", stack.settings.model.key)) == 0
            first = [d["batch"]["id"] for d in docs]
            # A frame taken twice (requeued and left in a list too) would be answered again after these answers:
            # a job submitted now is answered only after every frame ahead of it, as the list is first in, first
            # out and its batches are answered in the order they were taken. Once it is, nothing is left to
            # rewrite one of the four.
            later = stack.wait_terminal(stack.submit_ok(jpeg(320, 240, seed=attempt * 10 + 9)), timeout_s=90)
            assert later["status"] == "succeeded" and later["batch"]["seq"] > max(d["batch"]["seq"] for d in docs)
            assert stack.redis.llen(stack.frames_key) == 0 and stack.redis.llen(held) == 0
            assert [stack.job(j)["batch"]["id"] for j in ids] == first  # one answer each, never rewritten
            restarted.stop()
    finally:
        stack.start_gpu_worker()


def test_sigterm_with_a_batch_in_every_stage_answers_every_frame_taken(stack):
    """On the device, staged ahead of it, waiting for the write: SIGTERM stops the taking, not the answering."""
    stack.stop_gpu_worker()
    worker = None
    try:
        worker = slow_sim_worker(stack, "draining-gpu", latency_ms=700, max_batch=2)
        ids = [stack.submit_ok(jpeg(320, 240, seed=40 + i)) for i in range(24)]
        processing = stack.keys.processing("draining-gpu", stack.settings.model.key)
        # A batch on the device and one staged ahead (gpu_worker.lanes): the next batch is popped just in time,
        # tens of ms before the device is free, so both are held only that long in each batch's 700 ms: a fine
        # poll over a dozen batches meets it.
        wait_until(lambda: stack.redis.llen(processing) >= 4, 60, interval_s=0.002, what="batches in every stage")
        worker.stop(signal.SIGTERM, timeout_s=60)
        assert worker.process.returncode == 0, worker.log_tail()
        assert stack.redis.llen(processing) == 0
        statuses = [stack.job(j)["status"] for j in ids]
        assert statuses.count("succeeded") >= 4 and set(statuses) <= {"succeeded", "queued_gpu"}, statuses
        assert stack.redis.llen(stack.frames_key) == statuses.count("queued_gpu")  # the rest wait in line
    finally:
        if worker is not None and worker.alive():  # failed before its SIGTERM: left, it took the next tests' frames
            worker.stop(signal.SIGKILL, timeout_s=30)
        stack.start_gpu_worker()
    assert [stack.wait_terminal(j)["status"] for j in ids] == ["succeeded"] * len(ids)


def test_a_second_worker_with_a_live_workers_id_refuses_to_start(stack):
    """It would requeue the live one's frames at start (duplicate work) and neither could be reaped."""
    result = subprocess.run(
        gpu_worker_argv("sim", stack.gpu_worker_id),
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "is in use by pid" in result.stderr, result.stderr[-2000:]
    assert stack.gpu_worker.alive()
    assert stack.wait_terminal(stack.submit_ok(jpeg(64, 64)))["status"] == "succeeded"


def celery_children(parent_pid: int) -> list[int]:
    return sorted(children_of(parent_pid))


def test_a_celery_child_killed_mid_task_has_its_task_redelivered(stack):
    big = encode(make_image(6000, 6000), "PNG")  # about a second to decode: easy to hit mid-task
    assert len(big) < stack.settings.api.max_upload_bytes
    job_id = stack.submit_ok(big)
    wait_until(lambda: stack.job(job_id)["status"] == "preprocessing", 30, what="preprocessing to start")
    children = celery_children(stack.cpu_worker.process.pid)
    assert children
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    doc = stack.wait_terminal(job_id, timeout_s=120)
    assert doc["status"] == "succeeded", doc
    assert stack.cpu_worker.alive()


# --- backpressure -----------------------------------------------------------
def test_overload_is_refused_with_429_and_the_frame_list_stays_bounded(tight_stack):
    stack = tight_stack
    limits = stack.settings.backpressure
    stack.stop_gpu_worker()
    accepted, refused, longest = [], [], 0
    try:
        for i in range(30):
            response = stack.submit(jpeg(160, 120, seed=i))
            longest = max(longest, stack.redis.llen(stack.frames_key))
            if response.status_code == 202:
                accepted.append(response.json()["id"])
            else:
                refused.append(response)
        # The CPU worker stops taking this model's tasks once the list has no room for the tasks it may hold
        # (tasks.hop.full_lists: 2 children x prefetch 1), so the list settles between max_frames - 2 and
        # max_frames, depending on what its children held at that moment: not always full.
        wait_until(
            lambda: stack.redis.llen(stack.frames_key) >= limits.max_frames - 2,
            30,
            what="the frame list to fill up to where the CPU worker pauses",
        )
        watch_until = time.monotonic() + 1.0  # the children still holding frames push or wait: never past the bound
        while time.monotonic() < watch_until:
            longest = max(longest, stack.redis.llen(stack.frames_key))
            time.sleep(0.01)
    finally:
        stack.start_gpu_worker()
    assert refused and all(r.status_code == 429 for r in refused)
    # Retry-After says how long the backlog takes to drain: with no GPU worker answering, the longest.
    from app.drain import MAX_RETRY_AFTER_S

    assert all(limits.retry_after_s <= int(r.headers["Retry-After"]) <= MAX_RETRY_AFTER_S for r in refused)
    assert int(refused[-1].headers["Retry-After"]) == MAX_RETRY_AFTER_S
    assert refused[0].json()["type"] == "/problems/overloaded"
    assert longest <= limits.max_frames
    docs = [stack.wait_terminal(j, timeout_s=90) for j in accepted]
    assert [d["status"] for d in docs] == ["succeeded"] * len(accepted)
    # Frames that waited in a CPU worker for room are billed `backpressure` (the GPU worker was away for
    # seconds), not `queue_gpu`: each was stamped when it was finally pushed.
    # Whether a child waits here at all is a race since CPU workers pause a full list's queue (tasks.hop.full_lists);
    # the next test makes one wait for certain.
    waited = [d["timings_ms"] for d in docs if d["timings_ms"]["backpressure"] > 300]
    assert all(bill["queue_gpu"] < bill["backpressure"] for bill in waited)
    assert stack.submit(jpeg(160, 120)).status_code == 202  # back to normal by itself


def test_a_frame_that_waited_for_room_is_stamped_when_it_is_finally_pushed(tmp_path, request):
    """A CPU worker holding a frame for a full list waits (the bound holds, the frame is kept), then pushes
    it stamped at that moment: the wait is billed `backpressure`, and the frame does not reach the GPU
    worker looking a window late."""
    from contract.frames import unpack_frame
    from contract.redis.connection import connect
    from contract.redis.keys import Keys
    from contract.settings.config import load_settings
    from tasks.decoding.preprocess import Preprocessor

    # A Redis of its own: the test counts the worker's looks at the list in the server's command counts.
    server = RedisServer(tmp_path)
    request.addfinalizer(server.stop)
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "redis_url": server.url,
                "namespace": "waitroom",
                "backpressure": {"max_frames": 2},
            }
        )
    )
    settings = load_settings(config)
    client = connect(settings)
    client.flushdb()
    keys = Keys(settings.namespace)
    store = JobIntake(client, keys, ttl_s=60)
    frames = keys.frames(settings.model.key)
    now = time.time()
    fields = {"model": settings.model.key, "deadline_at": now + 60, "received_at": now, "submitted_at": now}
    store.create("e" * 32, jpeg(160, 120), 60, fields)
    client.lpush(frames, b"filler-1", b"filler-2")
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(Preprocessor(settings, connect(settings)).run("e" * 32)))
    worker.start()
    wait_until(lambda: store.load("e" * 32)["status"] == PREPROCESSING, 30, what="the job to be claimed")

    def lengths_read() -> int:
        return int(client.info("commandstats").get("cmdstat_llen", {}).get("calls", 0))

    # The wait under test: refused, the worker reads the list's length every room_poll_s, each read a moment it
    # could have pushed past the bound or given up. Counted from the claim (the test reads no length until the
    # assert below), less one the push's own script may make: `looks` reads after its refusal, so at least
    # `looks` sleeps, 0.4 s, holding its frame.
    looks, since_claim = math.ceil(0.4 / settings.backpressure.room_poll_s), lengths_read()
    wait_until(lambda: lengths_read() - since_claim >= 1 + looks, 30, what=f"the worker to look for room {looks} times")
    assert client.llen(frames) == 2 and not outcome  # still holding its frame: the bound holds
    room_made_at = time.time()
    client.rpop(frames)
    worker.join(timeout=30)
    assert outcome == ["pushed"]
    header = unpack_frame(client.lindex(frames, 0)).header
    assert header.job_id == "e" * 32
    assert header.stamps["pushed_at"] >= room_made_at and header.pushed_at == header.stamps["pushed_at"]
    assert header.stamps["backpressure_ms"] >= 400
    assert store.load("e" * 32)["status"] == QUEUED_GPU


# --- bad input ----------------------------------------------------------------
def gif_animated() -> bytes:
    frames = [Image.new("RGB", (64, 48), c) for c in ((200, 30, 30), (30, 30, 200))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


def exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(make_image(400, 200), "JPEG", exif=exif.tobytes())


def bomb() -> bytes:
    """A PNG declaring 30000 x 30000 pixels in a few hundred bytes."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(bytes(30001) * 4))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    "name,data,content_type,status,outcome",
    [
        ("empty body", b"", "image/jpeg", 400, None),
        ("random bytes as jpeg", os.urandom(4096), "image/jpeg", 415, None),
        ("png declared as jpeg", encode(make_image(50, 40), "PNG"), "image/jpeg", 202, ("succeeded", (50, 40))),
        ("truncated jpeg", jpeg(400, 300)[:600], "image/jpeg", 202, ("failed", "decode_error")),
        ("truncated png", encode(make_image(400, 300), "PNG")[:300], "image/png", 202, ("failed", "decode_error")),
        ("decompression bomb", bomb(), "image/png", 202, ("failed", "image_too_large")),
        ("1x10000", encode(make_image(1, 10000), "PNG"), "image/png", 202, ("succeeded", (1, 10000))),
        ("1x1", encode(make_image(1, 1), "PNG"), "image/png", 202, ("succeeded", (1, 1))),
        ("cmyk jpeg", encode(make_image(120, 80, mode="CMYK"), "JPEG"), "image/jpeg", 202, ("succeeded", (120, 80))),
        ("grayscale", encode(make_image(120, 80, mode="L"), "PNG"), "image/png", 202, ("succeeded", (120, 80))),
        (
            "palette with alpha",
            encode(make_image(120, 80, mode="P"), "PNG", transparency=0),
            "image/png",
            202,
            ("succeeded", (120, 80)),
        ),
        ("animated gif", gif_animated(), "image/gif", 202, ("succeeded", (64, 48))),
        ("exif rotated", exif_rotated(), "image/jpeg", 202, ("succeeded", (200, 400))),
    ],
)
def test_bad_and_odd_input(stack, name, data, content_type, status, outcome):
    response = stack.session.post(stack.url("/v1/jobs"), data=data, headers={"Content-Type": content_type}, timeout=30)
    assert response.status_code == status, (name, response.text)
    if outcome is None:
        assert response.headers["Content-Type"] == "application/problem+json"
        return
    doc = stack.wait_terminal(response.json()["id"])
    expected_status, detail = outcome
    assert doc["status"] == expected_status, (name, doc)
    if expected_status == "failed":
        assert doc["error"]["code"] == detail
        assert not stack.redis.exists(stack.keys.upload(doc["id"]))  # not kept for upload_ttl_s
        assert " at 0x" not in doc["error"]["message"]  # no memory addresses
    else:
        assert (doc["result"]["image"]["width"], doc["result"]["image"]["height"]) == detail


def test_small_files_that_decode_huge_are_served_or_refused_without_losing_the_worker(stack):
    import numpy as np

    sixteen_bit = encode(Image.fromarray(np.tile(np.arange(8900, dtype=np.uint16), (8900, 1))), "PNG")
    giant_rgb = encode(Image.new("RGB", (8900, 8900), (10, 20, 30)), "PNG")
    assert len(sixteen_bit) < 400_000 and len(giant_rgb) < 400_000
    ids = [stack.submit(data, "image/png").json()["id"] for data in (sixteen_bit, giant_rgb)]
    served, refused = (stack.wait_terminal(job_id, timeout_s=120) for job_id in ids)
    assert served["status"] == "succeeded" and served["result"]["image"] == {"width": 8900, "height": 8900}
    assert refused["status"] == "failed" and refused["error"]["code"] == "image_too_large"
    children = celery_children(stack.cpu_worker.process.pid)
    assert stack.cpu_worker.alive() and children


def test_malformed_multipart_is_400(stack):
    response = stack.session.post(
        stack.url("/v1/jobs"),
        data=b"--xx\r\nnonsense",
        headers={"Content-Type": "multipart/form-data; boundary=xx"},
        timeout=10,
    )
    assert response.status_code == 400


@pytest.mark.parametrize("options", [{"conf": "abc"}, {"deadline_ms": "-1"}, {"max_det": "0"}, {"iou": "2"}])
def test_bad_option_values_are_400(stack, options):
    response = stack.submit(jpeg(64, 64), **options)
    assert response.status_code == 400
    assert response.json()["invalid_params"][0]["name"] == next(iter(options))


def test_oversize_upload_is_413_from_its_declared_length(stack):
    """Refused from Content-Length alone: the server answers before reading the body."""
    import socket

    with socket.create_connection(("127.0.0.1", stack.api.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Content-Length: 999999999\r\n\r\n" + b"\xff\xd8\xff" + bytes(1000)
        )
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")


# --- Redis down -----------------------------------------------------------------
def test_redis_stopped_and_restarted_the_api_answers_503_then_everything_recovers(own_redis_stack):
    stack, server = own_redis_stack
    before = stack.submit_ok(jpeg(160, 120, seed=1))
    assert stack.wait_terminal(before)["status"] == "succeeded"
    server.stop()
    try:
        started = time.monotonic()
        response = stack.submit(jpeg(160, 120, seed=2))
        assert response.status_code == 503
        assert response.headers["Retry-After"] and response.json()["status"] == 503
        assert time.monotonic() - started < 10
        not_ready = stack.session.get(stack.url("/readyz"), timeout=10)
        assert not_ready.status_code == 503 and str(server.port) not in not_ready.text  # no host:port
    finally:
        server.start()
    # Workers reconnect by themselves: no process was restarted.
    wait_until(
        lambda: stack.session.get(stack.url("/readyz"), timeout=10).status_code == 200,
        60,
        what="readiness after Redis came back",
    )
    after = [stack.submit_ok(jpeg(160, 120, seed=3 + i)) for i in range(3)]
    assert [stack.wait_terminal(j, timeout_s=120)["status"] for j in after] == ["succeeded"] * 3
    assert stack.wait_terminal(before)["status"] == "succeeded"  # the append-only file kept it
    assert stack.cpu_worker.alive() and stack.gpu_worker.alive()


def test_a_gpu_worker_told_to_stop_while_redis_is_away_stops(own_redis_stack):
    """It used to retry Redis for ever, SIGTERM or not, until something killed it."""
    stack, server = own_redis_stack
    worker = stack.gpu_worker
    server.stop()
    try:
        wait_until(lambda: "redis unavailable" in worker.log_tail(), 60, what="the GPU worker to miss Redis")
        started = time.monotonic()
        status = worker.stop(signal.SIGTERM, timeout_s=30)
        assert status in (0, 1) and time.monotonic() - started < 15, worker.log_tail()
        assert "while stopping: giving up" in worker.log_tail()
    finally:
        server.start()
        stack.gpu_worker = None
        stack.start_gpu_worker()
    job_id = stack.submit_ok(jpeg(160, 120, seed=9))
    assert stack.wait_terminal(job_id, timeout_s=120)["status"] == "succeeded"


def test_a_job_ends_expired_at_its_deadline_though_nobody_reads_it(stack):
    """The CPU workers (and the API) sweep the deadline index: the job is over when its deadline passes,
    not when someone next looks."""

    store = api_services(stack.api.app).store
    stack.stop_gpu_worker()
    try:
        job_id = stack.submit_ok(jpeg(64, 64), deadline_ms=1500)
        deadline = store.load(job_id)["deadline_at"]
        record = wait_until(
            lambda: (r := store.load(job_id))["status"] == EXPIRED and r,
            10,
            interval_s=0.05,
            what="the job to expire unread",
        )
    finally:
        stack.start_gpu_worker()
    assert record["finished_at"] - deadline < 1.5  # within the sweep interval of its deadline
    assert record["error"]["code"] == "deadline"
    assert not stack.redis.exists(stack.keys.upload(job_id))
