"""`api.metrics_port`: the API's metrics on an internal port only, from every
gunicorn worker, and no /metrics on the public port (real gunicorn, real HTTP)."""

from __future__ import annotations

import re

import pytest
import requests

from bench.stack.processes import api_argv
from tests.support import ManagedProcess, answers_200, free_port, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gunicorn_api(stack, tmp_path_factory):
    public, internal = free_port(), free_port()
    env = {
        **stack.env,
        "IMGSERVE_API__BIND": f"127.0.0.1:{public}",
        "IMGSERVE_API__WORKERS": "2",
        "IMGSERVE_API__THREADS": "4",
        "IMGSERVE_API__METRICS_PORT": str(internal),
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    process = ManagedProcess(
        "api",
        api_argv(),
        env,
        tmp_path_factory.mktemp("gunicorn"),
    )
    base = f"http://127.0.0.1:{public}"
    wait_until(
        lambda: (
            answers_200(base + "/healthz")
            and answers_200(f"http://127.0.0.1:{internal}/metrics")
            or not process.alive()
        ),
        60,
        what="gunicorn with an internal metrics port",
    )
    assert process.alive(), process.log_tail()
    yield base, f"http://127.0.0.1:{internal}"
    process.stop()


def healthz_count(metrics_text: str) -> float:
    match = re.search(r'imgserve_api_requests_total\{method="GET",route="/healthz",status="200"\} (\S+)', metrics_text)
    return float(match.group(1)) if match else 0.0


def test_metrics_are_only_on_the_internal_port_and_count_every_worker(gunicorn_api):
    public, internal = gunicorn_api
    before = healthz_count(requests.get(internal + "/metrics", timeout=10).text)
    with requests.Session() as first, requests.Session() as second:  # two connections: likely both workers
        for _ in range(10):
            assert first.get(public + "/healthz", timeout=10).status_code == 200
            assert second.get(public + "/healthz", timeout=10).status_code == 200
    assert healthz_count(requests.get(internal + "/metrics", timeout=10).text) == before + 20
    hidden = requests.get(public + "/metrics", timeout=10)
    assert hidden.status_code == 404 and hidden.headers["Content-Type"] == "application/problem+json"
    assert "/metrics" not in requests.get(public + "/openapi.json", timeout=10).json()["paths"]
