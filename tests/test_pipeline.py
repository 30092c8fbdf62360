"""End to end over real HTTP, a real Celery worker, a real GPU-worker process
(CPU device) and a private Redis. The model is a TorchScript detector whose
answer is known: one box around the whole original image."""

from __future__ import annotations

import os
import time

import pytest

from contract.jobs.timebill import STAGES
from tests.support import encode, jpeg, make_image, wait_until

pytestmark = pytest.mark.integration


def assert_whole_image_box(doc: dict, width: int, height: int) -> None:
    assert doc["status"] == "succeeded", doc
    result = doc["result"]
    assert result["image"] == {"width": width, "height": height}
    assert result["model"] == {"name": "content-box", "version": "test"}
    [detection] = result["detections"]
    assert detection["label"] == "content" and detection["class_id"] == 0
    assert detection["score"] == pytest.approx(0.9)
    tolerance = 2.5 * max(width, height) / 320  # a couple of input pixels, in original pixels
    x1, y1, x2, y2 = detection["box"]
    assert 0 <= x1 <= tolerance and 0 <= y1 <= tolerance, detection
    assert width - tolerance <= x2 <= width and height - tolerance <= y2 <= height, detection


def test_submit_then_poll_gives_boxes_in_original_pixels_and_a_full_time_bill(stack):
    response = stack.submit(jpeg(1280, 720))
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "queued" and body["links"]["self"] == f"/v1/jobs/{body['id']}"
    assert response.headers["Location"] == body["links"]["self"]

    doc = stack.wait_terminal(body["id"])

    assert_whole_image_box(doc, 1280, 720)
    assert set(doc["timings_ms"]) == set(STAGES)
    bill = doc["timings_ms"]
    # One job on an empty list never waits for room: its `backpressure` is two clock reads around building a
    # dict (microseconds), under the one room_poll_s sleep that any wait for room would add.
    assert 0 <= bill["backpressure"] < stack.settings.backpressure.room_poll_s * 1000
    # device_queue is 0 unless a batch was ahead on the device; every other stage does real work.
    assert 0 <= bill["device_queue"] <= bill["total"]
    worked = [stage for stage in STAGES if stage not in ("backpressure", "device_queue", "total")]
    assert all(0 < bill[stage] < bill["total"] for stage in worked), bill
    # The stages are disjoint parts of the request's life, so they add up to the total less what no stage bills
    # (the CPU worker's claim, upload read and push; the GPU worker's result documents): Redis round trips and a
    # copy, never as much as the billed work. The 1 ms below 0: a process's clock may re-sync to Redis's within
    # the job (contract.redis.clock: within half a loopback round trip) and each stage is rounded to 1 us.
    billed = sum(value for stage, value in bill.items() if stage != "total")
    assert -1.0 <= bill["total"] - billed < billed, bill
    assert doc["batch"]["size"] >= 1 and doc["batch"]["id"].startswith(stack.gpu_worker_id)
    # The claim check is gone once the frame was pushed.
    assert not stack.redis.exists(stack.keys.upload(body["id"]))


@pytest.mark.parametrize("width,height", [(600, 1400), (1600, 500), (97, 61), (4000, 3000)])
def test_letterbox_is_undone_for_portrait_landscape_small_and_large(stack, width, height):
    job_id = stack.submit_ok(jpeg(width, height, seed=width))
    assert_whole_image_box(stack.wait_terminal(job_id), width, height)


def test_png_raw_body_and_per_request_options(stack):
    data = encode(make_image(300, 200, mode="RGBA"), "PNG")
    response = stack.session.post(
        stack.url("/v1/jobs?conf=0.95"), data=data, headers={"Content-Type": "image/png"}, timeout=30
    )
    assert response.status_code == 202, response.text
    doc = stack.wait_terminal(response.json()["id"])
    assert doc["status"] == "succeeded"
    assert doc["options"] == {"conf": 0.95}
    assert doc["result"]["detections"] == []  # the model's 0.9 is under the job's own threshold


def test_long_poll_returns_as_soon_as_the_job_ends(stack):
    job_id = stack.submit_ok(jpeg(640, 480))
    started = time.monotonic()
    doc = stack.job(job_id, wait=25)
    assert doc["status"] == "succeeded"
    assert time.monotonic() - started < 20  # woken by the job's end, not by the wait running out


def test_long_poll_waits_its_full_time_when_nothing_happens(stack):
    stack.stop_gpu_worker()
    try:
        job_id = stack.submit_ok(jpeg(320, 240))
        wait_until(lambda: stack.job(job_id)["status"] == "queued_gpu", 30, what="the frame to be queued")
        started = time.monotonic()
        doc = stack.job(job_id, wait=1.0)
        assert doc["status"] == "queued_gpu"
        assert time.monotonic() - started >= 0.9
    finally:
        stack.start_gpu_worker()
    assert stack.wait_terminal(job_id)["status"] == "succeeded"


def test_a_burst_of_32_is_carried_in_batches_of_at_most_8_in_fifo_order(stack):
    stack.stop_gpu_worker()
    try:
        ids = [stack.submit_ok(jpeg(480, 360, seed=i)) for i in range(32)]
        wait_until(lambda: stack.redis.llen(stack.frames_key) == 32, 60, what="32 frames on the list")
        # Producers LPUSH, so the list read right to left is the order frames were pushed.
        pushed_order = [_job_id_of(frame) for frame in reversed(stack.redis.lrange(stack.frames_key, 0, -1))]
    finally:
        stack.start_gpu_worker()
    docs = {job_id: stack.wait_terminal(job_id) for job_id in ids}

    assert sorted(pushed_order) == sorted(ids)
    assert all(doc["status"] == "succeeded" for doc in docs.values())
    sizes = {doc["batch"]["id"]: doc["batch"]["size"] for doc in docs.values()}
    assert max(sizes.values()) <= 8
    assert sum(sizes.values()) / len(sizes) > 4
    served_order = sorted(ids, key=lambda j: (docs[j]["batch"]["seq"], docs[j]["batch"]["index"]))
    assert served_order == pushed_order


def test_one_job_alone_is_dispatched_when_the_window_closes(stack):
    job_id = stack.submit_ok(jpeg(320, 320))
    doc = stack.wait_terminal(job_id)
    assert doc["batch"]["size"] == 1
    assert doc["batch"]["closed_by"] in ("window", "late")  # late: a stalled shared core let it age a window
    # The window runs on the worker's clock (12 ms), not on Redis's ~100 ms blocking timeouts; the bound is
    # wide because 2 shared cores can stall any thread for tens of ms (bench measures the real figure).
    assert doc["timings_ms"]["batch_wait"] < 90


def test_unknown_job_is_404_problem(stack):
    response = stack.session.get(stack.url("/v1/jobs/does-not-exist"), timeout=10)
    assert response.status_code == 404
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.json()["status"] == 404 and response.json()["type"] == "/problems/job-not-found"


def test_too_large_upload_is_413(stack):
    response = stack.submit(b"\xff\xd8\xff" + os.urandom(stack.settings.api.max_upload_bytes))
    assert response.status_code == 413
    assert response.json()["title"] == "Request Entity Too Large"


@pytest.mark.parametrize(
    "data,content_type",
    [
        (b"hello, not an image", "text/plain"),
        (os.urandom(2048), "image/jpeg"),
    ],
)
def test_non_images_are_415(stack, data, content_type):
    response = stack.session.post(stack.url("/v1/jobs"), data=data, headers={"Content-Type": content_type}, timeout=10)
    assert response.status_code == 415
    assert response.json()["type"] == "/problems/unsupported-media-type"


def test_bad_option_is_400(stack):
    response = stack.submit(jpeg(64, 64), conf="abc")
    assert response.status_code == 400
    assert response.json()["invalid_params"][0]["name"] == "conf"


def test_corrupt_image_fails_with_a_reason_and_workers_keep_serving(stack):
    corrupt = jpeg(640, 480)[:300] + os.urandom(500)
    bad_id = stack.submit_ok(corrupt)
    good_id = stack.submit_ok(jpeg(640, 480, seed=3))
    bad = stack.wait_terminal(bad_id)
    assert bad["status"] == "failed"
    assert bad["error"]["code"] == "decode_error"
    assert_whole_image_box(stack.wait_terminal(good_id), 640, 480)
    assert stack.cpu_worker.alive() and stack.gpu_worker.alive()


def test_models_and_readiness_describe_the_live_worker(stack):
    ready = stack.session.get(stack.url("/readyz"), timeout=10)
    assert ready.status_code == 200 and ready.json()["gpu_workers"] == 1
    [model] = stack.session.get(stack.url("/v1/models"), timeout=10).json()["models"]
    assert model["name"] == "content-box" and model["labels"] == ["content", "other"]
    assert model["input_size"] == 320 and model["devices"] == ["cpu"]
    assert stack.session.get(stack.url("/healthz"), timeout=10).json() == {"status": "ok"}


def test_stats_show_where_the_gpu_workers_host_time_goes(stack):
    assert stack.wait_terminal(stack.submit_ok(jpeg(320, 240)))["status"] == "succeeded"

    def host_times() -> dict:
        [worker] = stack.session.get(stack.url("/v1/stats"), timeout=10).json()["gpu_workers"]
        return worker["host_ms_per_batch"]

    # the worker's counters are written by its heartbeat (every third of its TTL), not by each batch's write
    host = wait_until(host_times, stack.settings.gpu_worker.heartbeat_ttl_s + 5, 0.25, what="the heartbeat's counters")
    assert list(host) == ["pop", "unpack", "triage", "stage", "forward", "readback", "documents", "write"]
    # Each stage's block is timed by the one thread that runs it, so its thread CPU time is within its wall time:
    # 0.01 ms over for the two clocks read one after the other and the totals rounded to 1 us. Every stage runs
    # Python code on every batch, so neither is 0.
    assert all(0 < times["cpu"] <= times["wall"] + 0.01 for times in host.values()), host
    assert host["forward"]["wall"] > 0


def _job_id_of(frame: bytes) -> str:
    from contract.frames import unpack_frame

    return unpack_frame(frame).header.job_id


def test_sigterm_stops_the_gpu_worker_cleanly_and_withdraws_its_heartbeat(stack):
    worker = stack.gpu_worker
    stack.stop_gpu_worker()
    try:
        assert worker.process.returncode == 0, worker.log_tail()
        assert not stack.redis.exists(stack.keys.heartbeat(stack.gpu_worker_id))
        assert stack.session.get(stack.url("/readyz"), timeout=10).status_code == 503
    finally:
        stack.start_gpu_worker()


def test_a_job_nobody_answers_expires_at_its_deadline(stack):
    stack.stop_gpu_worker()
    try:
        job_id = stack.submit_ok(jpeg(200, 200), deadline_ms=1500)
        doc = stack.job(job_id, wait=20)  # the wait ends at the deadline, not after 20 s
    finally:
        stack.start_gpu_worker()
    assert doc["status"] == "expired"
    assert doc["error"]["code"] == "deadline"
    # Its time bill comes from the record: the intake's and the claim's stamps, and the three durations the push
    # writes (contract.jobs.timebill.PUSH_STAMPS) though it no longer sends the stamps the record holds already.
    record = stack.redis.hgetall(stack.keys.job(job_id))
    assert record[b"received_at"] and record[b"submitted_at"], record
    if b"pushed_at" in record:  # pushed before its deadline (on a loaded machine it may expire at its claim)
        assert {"receive", "queue_cpu", "decode", "resize", "backpressure", "total"} <= set(doc["timings_ms"]), doc


def test_one_job_can_be_followed_through_every_process_by_its_id(stack, caplog):
    import json as _json
    import logging

    with caplog.at_level(logging.INFO, logger="api"):
        job_id = stack.submit_ok(jpeg(200, 150))
        assert stack.wait_terminal(job_id)["status"] == "succeeded"
    assert any(getattr(r, "job_id", None) == job_id for r in caplog.records)  # the API

    def lines_about(process) -> list[dict]:
        entries = []
        for line in process.log_path.read_text().splitlines():
            if line.startswith("{"):
                entry = _json.loads(line)
                if entry.get("job_id") == job_id or job_id in entry.get("job_ids", ()):
                    entries.append(entry)
        return entries

    cpu = wait_until(lambda: lines_about(stack.cpu_worker), 10, what="the CPU worker's line")
    gpu = wait_until(lambda: lines_about(stack.gpu_worker), 10, what="the GPU worker's line")
    assert cpu[0]["role"] == "cpu-worker" and cpu[0]["outcome"] == "pushed"
    assert gpu[0]["role"] == "gpu-worker" and gpu[0]["msg"] == "batch answered"  # one line per batch


def test_deployments_sharing_a_redis_database_never_take_each_others_tasks(stack):
    from contract.jobs.task_messages import PreprocessMessages
    from contract.redis.keys import Keys

    # Another deployment's API queues a task as this one's does (contract.jobs.task_messages), under its namespace.
    stack.redis.lpush(
        Keys("another-deployment").celery_queue("preprocess"), PreprocessMessages().build("0" * 32, "preprocess")
    )
    other_queue = "another-deployment:celery:preprocess"
    assert stack.redis.llen(other_queue) == 1
    assert stack.wait_terminal(stack.submit_ok(jpeg(64, 64)))["status"] == "succeeded"  # this stack's worker runs
    assert stack.redis.llen(other_queue) == 1  # and left that one alone
    assert stack.redis.exists(stack.keys.celery_prefix + "_kombu.binding.preprocess")
    stack.redis.delete(other_queue)
