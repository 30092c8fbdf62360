"""Issue 70, finding 4: a read of a 1,000-detection job cost the API ten times a small one's CPU (its result
parsed, validated and encoded again on every read), and a few connections re-reading one starved the process's
other requests. The result is now served as the GPU worker stored it: the same bytes, never parsed."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
import redis
import requests
from flask import jsonify

from app import create_app
from app.services import services
from bench.load.reads import finished_job, result_document, store_job
from contract.documents import job_document
from contract.jobs.record import decode_record, new_job_id
from contract.redis.clock import now as service_now
from contract.settings.config import load_settings
from tests.support import ApiServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api(redis_server) -> Iterator[ApiServer]:
    settings = dataclasses.replace(load_settings(), redis_url=redis_server.url, namespace="test-job-reads")
    server = ApiServer(create_app(settings))
    yield server
    server.stop()


def stored(api: ApiServer, result: dict | str) -> str:
    """A succeeded job with `result` (a dict: stored as the GPU worker writes it; text: stored as it is)."""
    job_id = new_job_id()
    client = redis.Redis.from_url(services(api.app).settings.redis_url)
    store_job(client, services(api.app).keys, finished_job(job_id, result, service_now()))
    return job_id


def test_a_large_result_is_served_as_the_bytes_stored_and_the_document_is_unchanged(api):
    """Stored with spaces after its separators (the GPU worker writes compact JSON), a 1,000-detection result
    that was parsed and encoded again would come back compact: it comes back byte for byte. And what a client
    reads is unchanged: a result stored as the GPU worker writes it gives the body that parsing and validating
    it gave, byte for byte, for a small answer and a large one."""
    document = result_document(1000)
    text = json.dumps(document)  # ", " and ": ": not what an encoder of the API writes
    response = requests.get(f"{api.url}/v1/jobs/{stored(api, text)}", timeout=10)
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/json"
    assert response.content.count(text.encode()) == 1
    assert response.json()["result"] == document and response.json()["status"] == "succeeded"

    client = redis.Redis.from_url(services(api.app).settings.redis_url)
    for detections in (3, 1000):
        job_id = stored(api, result_document(detections, seed=detections))
        served = requests.get(f"{api.url}/v1/jobs/{job_id}", timeout=10)
        with api.app.app_context():
            parsed = jsonify(job_document(decode_record(client.hgetall(services(api.app).keys.job(job_id)))))
        assert served.status_code == 200 and served.content == parsed.get_data()
        assert len(served.json()["result"]["detections"]) == detections
