"""Two cells under compose, run for real: docker-compose.yml with docker-compose.cells.yml laid over it
(docs/running-cells.md's command), on the CPU device, generated secrets.

It brings up a second stack beside the README's (two Redis servers, two sets of workers, two Flowers), which CI's
2 cores and its 15 minutes do not hold: `make compose-test` runs it only with IMGSERVE_COMPOSE_CELLS=1
(`IMGSERVE_COMPOSE_CELLS=1 scripts/compose-test tests/compose/test_compose_cells.py`); its last run is in
docs/benchmarks/2026-12-07-cells.md."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import requests

from tests.compose.test_compose_stack import Deployment, _generated_secrets, _ready
from tests.support import REPO_ROOT, free_port, jpeg, wait_until

pytestmark = pytest.mark.compose

PROJECT = "imgserve-compose-cells-test"
FILES = ["docker-compose.yml", "docker-compose.cells.yml"]
START_S = 240.0


@pytest.fixture(scope="module")
def cells() -> Iterator[Deployment]:
    if not os.environ.get("IMGSERVE_COMPOSE_TEST") or not os.environ.get("IMGSERVE_COMPOSE_CELLS"):
        pytest.skip("IMGSERVE_COMPOSE_CELLS=1 scripts/compose-test tests/compose/test_compose_cells.py runs it")
    generated = _generated_secrets()
    ports = {name: free_port() for name in ("api", "flower", "flower_b", "prometheus")}
    env = {
        **{k: v for k, v in os.environ.items() if k not in generated and k != "COMPOSE_FILE"},
        **generated,
        "API_PORT": str(ports["api"]),
        "FLOWER_PORT": str(ports["flower"]),
        "FLOWER_B_PORT": str(ports["flower_b"]),
        "PROMETHEUS_PORT": str(ports["prometheus"]),
        "CPU_WORKER_CONCURRENCY": "1",
        "CPU_WORKER_MEMORY": "1g",
    }
    stack = Deployment(
        [REPO_ROOT / name for name in FILES],
        env,
        generated,
        api=f"http://127.0.0.1:{ports['api']}",
        flower=f"http://127.0.0.1:{ports['flower']}",
        receiver="",
        prometheus=None,
        project=PROJECT,
    )
    stack.compose("down", "-v", "--remove-orphans", check=False)
    try:
        stack.compose("build", timeout=1800)
        stack.compose("up", "-d", timeout=START_S)
        wait_until(lambda: _ready(stack), START_S, interval_s=0.5, what="the API's /readyz")
        yield stack
    finally:
        print(stack.compose("logs", "--no-color", "--tail", "20", check=False).stdout)
        down = stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
        assert down.returncode == 0, down.stderr


def _cells_up(stack: Deployment) -> dict[str, str]:
    stats = requests.get(f"{stack.api}/v1/stats", timeout=10).json()
    return {cell["name"]: cell["status"] for cell in stats["cells"]["cells"]}


def test_both_cells_are_up_and_jobs_succeed_in_each(cells: Deployment):
    # Each cell's GPU worker heartbeats in its own Redis before the chooser sends it work.
    wait_until(lambda: _cells_up(cells) == {"a": "up", "b": "up"}, START_S, interval_s=1.0, what="both cells up")
    ids = [cells.submit_ok(jpeg(320, 240, seed=seed)) for seed in range(12)]
    docs = [cells.wait_terminal(job_id) for job_id in ids]
    assert {doc["status"] for doc in docs} == {"succeeded"}, [doc.get("error") for doc in docs]
    stats = requests.get(f"{cells.api}/v1/stats", timeout=10).json()
    print(stats["cells"])
    # A format-2 id names its cell (contract.jobs.ids): the 12th hex digit after the format and the moment.
    assert {job_id[0] for job_id in ids} == {"2"}
    assert len({job_id[12] for job_id in ids}) == 2, "every job went to one cell"


def test_each_cells_flower_answers_with_its_auth(cells: Deployment):
    user, password = cells.flower_auth
    for port in (cells.env["FLOWER_PORT"], cells.env["FLOWER_B_PORT"]):
        response = requests.get(f"http://127.0.0.1:{port}/api/workers", auth=(user, password), timeout=10)
        assert response.status_code == 200, response.text
