"""With nothing listening at the Redis address, the API answers 503 problems, fast."""

from __future__ import annotations

import dataclasses
import time

import pytest
import requests

from app import create_app
from contract.settings.config import load_settings
from tests.support import ApiServer, free_port, jpeg


@pytest.fixture(scope="module")
def api_without_redis():
    settings = load_settings()
    settings = dataclasses.replace(
        settings,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        redis=dataclasses.replace(settings.redis, timeout_s=0.5),
    )
    server = ApiServer(create_app(settings))
    yield server
    server.stop()


def test_submit_is_503_with_retry_after_when_redis_is_down(api_without_redis):
    started = time.monotonic()
    response = requests.post(api_without_redis.url + "/v1/jobs", files={"image": ("a.jpg", jpeg(64, 64))}, timeout=30)
    assert response.status_code == 503
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.headers["Retry-After"] == "1"
    assert response.json()["type"] == "/problems/backend-unavailable"
    assert time.monotonic() - started < 10


def test_readiness_is_503_and_liveness_200_when_redis_is_down(api_without_redis):
    assert requests.get(api_without_redis.url + "/readyz", timeout=30).status_code == 503
    assert requests.get(api_without_redis.url + "/healthz", timeout=30).status_code == 200


def test_a_large_multipart_part_is_parsed_in_memory_not_spooled_to_disk(monkeypatch):
    """Werkzeug spools a part over 500 KB to a temporary file; the body is already in memory."""
    import io

    from werkzeug import formparser
    from werkzeug.test import EnvironBuilder

    from app import InMemoryFormRequest

    def no_disk(*args, **kwargs):
        raise AssertionError("a part went to a temporary file")

    monkeypatch.setattr(formparser, "SpooledTemporaryFile", no_disk)
    photo = bytes(900_000)
    environ = EnvironBuilder(method="POST", data={"image": (io.BytesIO(photo), "a.jpg", "image/jpeg")}).get_environ()
    request = InMemoryFormRequest(environ)
    assert request.files["image"].read() == photo


def test_every_route_refuses_a_query_parameter_it_does_not_take(api_without_redis):
    """Issue 53: `GET /v1/jobs/<id>?wiat=10` answered 200 at once, no long-poll and no word why. Every route
    now refuses what it does not take, before anything else (here, before Redis is found missing)."""
    app = api_without_redis.app
    job_id = "0" * 32
    routes = [
        (method, rule.rule.replace("<job_id>", job_id))
        for rule in app.url_map.iter_rules()
        if getattr(app.view_functions[rule.endpoint], "openapi", None) is not None
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})
    ]
    assert ("GET", f"/v1/jobs/{job_id}") in routes and ("GET", "/healthz") in routes and len(routes) >= 10
    for method, path in routes:
        response = requests.request(method, api_without_redis.url + path, params={"wiat": "10"}, timeout=30)
        assert response.status_code == 400, (method, path, response.text)
        assert response.headers["Content-Type"] == "application/problem+json"
        problem = response.json()
        assert problem["invalid_params"] == [{"name": "wiat", "reason": "not a query parameter of this operation"}]
        assert "'wiat'" in problem["detail"], problem
    wait = requests.get(f"{api_without_redis.url}/v1/jobs/{job_id}", params={"wiat": "10"}, timeout=30).json()
    assert wait["detail"] == "unknown query parameter(s): 'wiat'; GET /v1/jobs/<job_id> takes wait"
    fine = requests.get(api_without_redis.url + "/healthz", params={}, timeout=30)
    assert fine.status_code == 200
