"""Issue 52's leaks: with API keys, `/metrics` on the API's port answered anyone (every tenant's job counts and
cache hits), `/v1/models` showed any key every tenant's queue depth, jobs answered and p95 (`/v1/stats`, the
same figures, was admin-only already), and Flower's `/metrics` and `/healthcheck` answered without its
credentials. Each is now an admin key's (or Flower's credentials'), and says so to anyone else."""

from __future__ import annotations

import base64

import pytest
import requests

from app.auth import hash_key
from bench.stack.processes import ManagedProcess, free_port, python_argv
from tests.support import api_with_keys, as_key, jpeg, wait_until

pytestmark = pytest.mark.integration

KEYS = (
    {"id": "tenant", "sha256": hash_key("tenant-key")},
    {"id": "ops", "sha256": hash_key("ops-key"), "admin": True},
)


@pytest.fixture(scope="module")
def keyed_api(stack):
    with api_with_keys(stack.settings, KEYS) as server:
        yield server


def test_metrics_on_the_api_port_need_an_admin_key(keyed_api):
    for key, status in ((None, 401), ("wrong", 401), ("tenant-key", 403)):
        answer = requests.get(keyed_api.url + "/metrics", headers=as_key(key), timeout=10)
        assert answer.status_code == status and answer.headers["Content-Type"] == "application/problem+json"
        assert "imgserve_api" not in answer.text
    admin = requests.get(keyed_api.url + "/metrics", headers=as_key("ops-key"), timeout=10)
    assert admin.status_code == 200 and "imgserve_api_requests_total" in admin.text
    described = requests.get(keyed_api.url + "/openapi.json", timeout=10).json()["paths"]["/metrics"]["get"]
    assert {"401", "403"} <= set(described["responses"]) and described.get("security")


def test_models_show_every_tenants_figures_to_an_admin_key_only(keyed_api, stack):
    """A job of the tenant's ran first: the figures exist (a queue, jobs answered, a p95)."""
    submitted = requests.post(
        keyed_api.url + "/v1/jobs",
        data=jpeg(64, 64),
        headers={"Content-Type": "image/jpeg", **as_key("tenant-key")},
        timeout=30,
    )
    requests.get(
        f"{keyed_api.url}/v1/jobs/{submitted.json()['id']}",
        params={"wait": 20},
        headers=as_key("tenant-key"),
        timeout=30,
    )
    wait_until(
        lambda: requests.get(keyed_api.url + "/v1/models", headers=as_key("ops-key"), timeout=10).json()["models"][0][
            "recent_jobs"
        ],
        30,
        what="the GPU worker's heartbeat to count the job",
    )
    tenant = requests.get(keyed_api.url + "/v1/models", headers=as_key("tenant-key"), timeout=10).json()["models"][0]
    admin = requests.get(keyed_api.url + "/v1/models", headers=as_key("ops-key"), timeout=10).json()["models"][0]
    assert tenant["queue"] is None and tenant["p95_ms"] is None and tenant["recent_jobs"] is None
    assert admin["queue"] == {"preprocess": 0, "frames": 0} and admin["recent_jobs"] >= 1 and admin["p95_ms"] > 0
    shared = {"name", "version", "labels", "input_size", "state", "share", "default", "workers", "devices"}
    assert {name: tenant[name] for name in shared} == {name: admin[name] for name in shared}
    # Without keys there are no tenants: the figures are everyone's (the stack's own API).
    assert requests.get(stack.url("/v1/models"), timeout=10).json()["models"][0]["queue"] is not None


@pytest.fixture(scope="module")
def flower(stack, tmp_path_factory):
    port = free_port()
    env = {**stack.env, "FLOWER_BASIC_AUTH": "flower:a-password-of-some-length"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    process = ManagedProcess(
        "flower",
        python_argv("-m", "celery", "-A", "tasks.flower", "flower", "--address=127.0.0.1", f"--port={port}"),
        env,
        tmp_path_factory.mktemp("flower"),
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return requests.get(url + "/healthcheck", auth=("flower", "a-password-of-some-length"), timeout=2).ok
        except requests.RequestException:
            return False

    wait_until(lambda: answers() or not process.alive(), 60, what="Flower to answer")
    assert process.alive(), process.log_tail()
    yield url
    process.stop()


def test_every_flower_route_needs_its_credentials(flower):
    """/metrics (every task's counts by name and worker) and /healthcheck answered anyone; an unknown path
    answered 404 (routes could be told apart). Flower's own scripts and styles stay open: the same everywhere."""
    good = ("flower", "a-password-of-some-length")
    wrong = {"Authorization": "Basic " + base64.b64encode(b"flower:wrong").decode()}
    for path in ("/metrics", "/healthcheck", "/workers", "/api/tasks", "/no-such-page"):
        assert requests.get(flower + path, timeout=10).status_code == 401, path
        assert requests.get(flower + path, headers=wrong, timeout=10).status_code == 401, path
    assert requests.post(flower + "/api/task/async-apply/x", timeout=10).status_code in (401, 403)
    assert "flower_events_total" in requests.get(flower + "/metrics", auth=good, timeout=10).text
    assert requests.get(flower + "/healthcheck", auth=good, timeout=10).text == "OK"
    assert requests.get(flower + "/no-such-page", auth=good, timeout=10).status_code == 404
    assert requests.get(flower + "/static/css/flower.css", timeout=10).status_code == 200
