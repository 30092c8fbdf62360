"""API keys, per-key visibility and the per-key rate limit, over real HTTP.
A second API with keys configured serves the same queues as the stack's."""
from __future__ import annotations

import dataclasses

import pytest
import requests

from app import create_app
from app.auth import hash_key
from tests.support import ApiServer, jpeg

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def keyed_api(stack):
    auth = dataclasses.replace(stack.settings.auth, rate_per_s=2.0, burst=3.0, api_keys=(
        {"id": "team-a", "sha256": hash_key("key-a")}, {"id": "team-b", "sha256": hash_key("key-b")},
        {"id": "team-c", "sha256": hash_key("key-c")}, {"id": "ops", "sha256": hash_key("key-ops"), "admin": True}))
    server = ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth)))
    yield server
    server.stop()


def as_key(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_without_a_key_v1_is_refused_but_health_stays_open(keyed_api):
    for headers in (as_key(None), as_key("wrong")):
        response = requests.post(keyed_api.url + "/v1/jobs", data=jpeg(64, 64), timeout=10,
                                 headers={"Content-Type": "image/jpeg", **headers})
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(keyed_api.url + "/healthz", timeout=10).status_code == 200
    assert requests.get(keyed_api.url + "/readyz", timeout=10).status_code == 200


def test_a_job_is_visible_only_to_the_key_that_created_it(keyed_api, stack):
    response = requests.post(keyed_api.url + "/v1/jobs", data=jpeg(64, 64), timeout=10,
                             headers={"Content-Type": "image/jpeg", **as_key("key-a")})
    assert response.status_code == 202
    job_url = keyed_api.url + response.json()["links"]["self"]
    mine = requests.get(job_url, params={"wait": 20}, headers=as_key("key-a"), timeout=40)
    assert mine.status_code == 200 and mine.json()["status"] == "succeeded"
    theirs = requests.get(job_url, headers=as_key("key-b"), timeout=10)
    assert theirs.status_code == 404
    assert requests.delete(job_url, headers=as_key("key-b"), timeout=10).status_code == 404


def test_each_key_has_its_own_token_bucket(keyed_api):
    statuses = [requests.get(keyed_api.url + "/v1/models", headers=as_key("key-b"), timeout=10)
                for _ in range(6)]
    limited = [r for r in statuses if r.status_code == 429]
    assert limited and int(limited[0].headers["Retry-After"]) >= 1
    assert limited[0].json()["type"] == "/problems/rate-limited"
    assert requests.get(keyed_api.url + "/v1/models", headers=as_key("key-a"), timeout=10).status_code == 200


def test_only_an_admin_key_sees_every_tenants_traffic(keyed_api):
    tenant = requests.get(keyed_api.url + "/v1/stats", headers=as_key("key-c"), timeout=10)
    assert tenant.status_code == 403 and tenant.json()["type"] == "/problems/forbidden"
    admin = requests.get(keyed_api.url + "/v1/stats", headers=as_key("key-ops"), timeout=10)
    assert admin.status_code == 200 and "queues" in admin.json()
