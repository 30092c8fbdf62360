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


def test_the_rate_limit_holds_under_concurrent_clients(stack):
    """50 connections at once, each one request: at most the burst (and what the rate refills meanwhile) gets
    through. With each API process's own clock in the bucket, 75 got through against a bound of 50."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    auth = dataclasses.replace(stack.settings.auth, rate_per_s=5.0, burst=20.0,
                               api_keys=({"id": "racer", "sha256": hash_key("key-race")},))
    servers = [ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth))) for _ in range(2)]
    stack.redis.delete(stack.keys.rate_bucket("racer"))
    try:
        def one(i: int) -> int:
            return requests.get(servers[i % 2].url + "/v1/models", headers=as_key("key-race"), timeout=30).status_code
        started = time.monotonic()
        with ThreadPoolExecutor(50) as pool:
            codes = list(pool.map(one, range(150)))
        elapsed = time.monotonic() - started
    finally:
        for server in servers:
            server.stop()
    allowed = codes.count(200)
    assert set(codes) <= {200, 429} and codes.count(429) > 0
    assert allowed <= 20 + 5.0 * elapsed + 1, (allowed, elapsed)


def test_an_address_that_keeps_failing_to_authenticate_is_throttled(stack):
    auth = dataclasses.replace(stack.settings.auth, failed_per_s=1.0, failed_burst=5.0,
                               api_keys=({"id": "real", "sha256": hash_key("key-real")},))
    server = ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth)))
    stack.redis.delete(stack.keys.auth_failures("127.0.0.1"))
    try:
        guesses = [requests.get(server.url + "/v1/models", headers=as_key(f"guess-{i}"), timeout=10)
                   for i in range(30)]
        real = requests.get(server.url + "/v1/models", headers=as_key("key-real"), timeout=10)
    finally:
        server.stop()
    codes = [r.status_code for r in guesses]
    assert codes[:5] == [401] * 5 and 429 in codes and codes.count(401) <= 8
    throttled = next(r for r in guesses if r.status_code == 429)
    assert throttled.json()["type"] == "/problems/too-many-failed-authentications"
    assert int(throttled.headers["Retry-After"]) >= 1
    assert real.status_code == 200                   # a right key is never what the throttle counts
