"""A job the store lost answers 410 job-lost, to its own key only; an id past its records' TTL, or not shaped as
ours, 404. With replicas to confirm on and none acknowledging, the API does not call a job lost on what it read
(503: ask again), since that read may have come from a server that no longer holds the service's data."""

from __future__ import annotations

import dataclasses

import requests

from app import create_app
from app.services import services
from contract.redis.clock import now as service_now
from contract.settings.config import load_settings
from tests.support import ApiServer


def _api(redis_url: str, min_replicas: int) -> ApiServer:
    settings = load_settings()
    settings = dataclasses.replace(
        settings,
        redis_url=redis_url,
        namespace="lost",
        redis=dataclasses.replace(settings.redis, min_replicas=min_replicas, replica_timeout_ms=100),
    )
    return ApiServer(create_app(settings))


def test_a_missing_job_within_its_ttl_is_410_and_one_past_it_404(redis_server):
    api = _api(redis_server.url, min_replicas=0)
    try:
        ids = services(api.app).job_ids
        lost = ids.new()
        response = requests.get(f"{api.url}/v1/jobs/{lost}", timeout=10)
        assert response.status_code == 410
        assert response.headers["Content-Type"] == "application/problem+json"
        assert response.json()["type"] == "/problems/job-lost"
        two_days_ago = ids.new(at=service_now() - 2 * 86400)
        assert requests.get(f"{api.url}/v1/jobs/{two_days_ago}", timeout=10).status_code == 404
        assert requests.get(f"{api.url}/v1/jobs/not-an-id", timeout=10).status_code == 404
    finally:
        api.stop()


def test_without_the_replicas_to_confirm_on_a_missing_job_is_not_called_lost(redis_server):
    api = _api(redis_server.url, min_replicas=1)  # one replica wanted; this server has none
    try:
        response = requests.get(f"{api.url}/v1/jobs/{services(api.app).job_ids.new()}", timeout=10)
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
    finally:
        api.stop()
