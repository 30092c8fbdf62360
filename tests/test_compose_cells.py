"""docker-compose.cells.yml laid over the main file: a second cell whose workers know only its own Redis, and an
API that knows both cells (docker-compose config, as tests/test_deploy_files.py reads compose files)."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import yaml

from tests.support import REPO_ROOT
from tests.test_deploy_files import SECRETS, compose_config
from tools.cells import read_cells_setting
from tools.procfile import parse_procfile

FILES = ("-f", "docker-compose.yml", "-f", "docker-compose.cells.yml")
WORKER_ROLES = sorted(set(parse_procfile((REPO_ROOT / "Procfile").read_text())) - {"api"})
CELL_REDIS = {"a": "redis", "b": "redis-b"}


@pytest.fixture(scope="module")
def services() -> dict:
    result = compose_config(SECRETS, *FILES, "--profile", "monitoring")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def cell_services(cell: str) -> list[str]:
    return [role if cell == "a" else f"{role}-{cell}" for role in WORKER_ROLES]


def redis_host(url: str) -> str:
    return str(urlsplit(url).hostname)


@pytest.mark.parametrize("cell", ["a", "b"])
def test_each_cells_workers_point_at_their_cells_redis_only(services, cell):
    for name in cell_services(cell):
        env = services[name]["environment"]
        assert redis_host(env["IMGSERVE_REDIS_URL"]) == CELL_REDIS[cell], name
        assert "IMGSERVE_CELLS" not in env, name  # a cell's workers know nothing of the others
        others = [host for other, host in CELL_REDIS.items() if other != cell]
        assert not any(f"@{host}:" in str(value) for value in env.values() for host in others), name
        assert services[name]["depends_on"][CELL_REDIS[cell]]["condition"] == "service_started", name
    assert services[CELL_REDIS[cell]]["volumes"] != []


def test_the_api_knows_both_cells_and_keeps_cell_as_redis_as_its_own(services):
    env = services["api"]["environment"]
    cells = read_cells_setting(env["IMGSERVE_CELLS"])
    assert [(entry["name"], redis_host(str(entry["redis_url"]))) for entry in cells] == [
        ("a", "redis"),
        ("b", "redis-b"),
    ]
    assert all(urlsplit(str(entry["redis_url"])).password == SECRETS["REDIS_PASSWORD"] for entry in cells)
    assert redis_host(env["IMGSERVE_REDIS_URL"]) == "redis"
    assert {"redis", "redis-b"} <= set(services["api"]["depends_on"])


def test_the_second_cell_keeps_the_main_files_protections(services):
    b_redis = " ".join(services["redis-b"]["command"])
    assert "requirepass" in b_redis and "--appendonly yes" in b_redis and "--maxmemory-policy noeviction" in b_redis
    assert services["flower-b"]["environment"]["FLOWER_BASIC_AUTH"] == SECRETS["FLOWER_BASIC_AUTH"]
    assert services["flower-b"]["ports"] == ["127.0.0.1:5556:5555/tcp"]  # FLOWER_B_PORT: beside cell a's 5555
    for name, service in services.items():
        command = " ".join(service.get("command") or [])
        assert not any(secret in command for secret in SECRETS.values()), name
        if name != "check-secrets":
            assert service["depends_on"]["check-secrets"]["condition"] == "service_completed_successfully", name
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}"
            assert name == "api" or published.startswith("127.0.0.1:"), (name, port)


def test_prometheus_labels_each_cells_gpu_worker_with_its_cell(services):
    mounted = {volume.split(":")[1]: volume.split(":")[0] for volume in services["prometheus"]["volumes"]}
    assert mounted["/etc/prometheus/prometheus.yml"].endswith("monitoring/prometheus.cells.yml")
    config = yaml.safe_load((REPO_ROOT / "monitoring" / "prometheus.cells.yml").read_text())
    [gpu] = [job for job in config["scrape_configs"] if job["job_name"] == "gpu-worker"]
    labelled = {target: group["labels"]["cell"] for group in gpu["static_configs"] for target in group["targets"]}
    assert labelled == {"gpu-worker:9100": "a", "gpu-worker-b:9100": "b"}
    assert all(target.split(":")[0] in services for target in labelled)


def test_the_gpu_overlay_still_lays_over_both(services):
    result = compose_config(SECRETS, *FILES, "-f", "docker-compose.gpu.yml")
    assert result.returncode == 0, result.stderr
    merged = yaml.safe_load(result.stdout)["services"]
    assert merged["gpu-worker"]["command"][-1] == "cuda" and merged["gpu-worker-b"]["command"][-1] == "auto"
