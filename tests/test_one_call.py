"""`POST /v1/jobs?wait=S`: the job in one call. 200 with the finished job (whatever its end) when it ends within
S seconds, the 202 of a plain submission otherwise; a bad `wait` is refused before the body is read."""

from __future__ import annotations

import time

import pytest

from tests.support import jpeg, wait_until
from tests.test_pipeline import assert_whole_image_box

pytestmark = pytest.mark.integration


def post(stack, data: bytes, **params):
    return stack.session.post(
        stack.url("/v1/jobs"), params=params, data=data, headers={"Content-Type": "image/jpeg"}, timeout=60
    )


def test_one_call_answers_200_with_the_finished_job_as_a_read_gives_it(stack):
    response = post(stack, jpeg(640, 480, seed=41), wait=20)
    assert response.status_code == 200, response.text
    doc = response.json()
    assert_whole_image_box(doc, 640, 480)
    assert response.headers["Content-Location"] == f"/v1/jobs/{doc['id']}"
    assert "Location" not in response.headers
    assert stack.job(doc["id"]) == doc  # the same document a read answers


def test_one_call_that_outlasts_its_wait_answers_the_202_and_the_job_goes_on(stack):
    stack.stop_gpu_worker()
    try:
        started = time.monotonic()
        response = post(stack, jpeg(320, 240, seed=42), wait=1)
        waited = time.monotonic() - started
        assert response.status_code == 202, response.text
        body = response.json()
        assert body["status"] in ("queued", "preprocessing", "queued_gpu")  # where it stood when the wait ended
        assert response.headers["Location"] == body["links"]["self"]
        assert waited >= 0.9  # it did wait
    finally:
        stack.start_gpu_worker()
    assert stack.wait_terminal(body["id"])["status"] == "succeeded"


def test_one_call_of_a_broken_image_answers_200_failed_with_its_reason(stack):
    response = post(stack, b"\xff\xd8\xff\xe0" + b"\x00" * 64 + b"broken", wait=20)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "failed" and response.json()["error"]["code"] == "decode_error"


def test_one_call_past_its_deadline_answers_200_expired(stack):
    stack.stop_gpu_worker()
    try:
        response = post(stack, jpeg(320, 240, seed=43), wait=10, deadline_ms=400)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "expired"
    finally:
        stack.start_gpu_worker()


@pytest.mark.parametrize("wait", ["31", "-1", "soon", "nan", "inf"])
def test_a_bad_wait_is_400_naming_it_before_the_body_is_read(stack, wait):
    response = post(stack, jpeg(64, 64), wait=wait)
    assert response.status_code == 400 and response.headers["Content-Type"] == "application/problem+json"
    assert [p["name"] for p in response.json()["invalid_params"]] == ["wait"]


def test_wait_is_a_query_parameter_only(stack):
    response = stack.submit(jpeg(64, 64), wait=5)  # as a form field
    assert response.status_code == 400
    assert [p["name"] for p in response.json()["invalid_params"]] == ["wait"]


def test_many_one_calls_at_once_each_get_their_own_job(stack):
    from concurrent.futures import ThreadPoolExecutor

    images = [jpeg(200 + i, 150, seed=50 + i) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda image: post(stack, image, wait=30), images))
    assert [r.status_code for r in responses] == [200] * len(images)
    assert [r.json()["result"]["image"]["width"] for r in responses] == [200 + i for i in range(len(images))]
    wait_until(
        lambda: all(stack.job(r.json()["id"])["status"] == "succeeded" for r in responses),
        10,
        what="every job readable as it was answered",
    )
