"""The compose file and the Procfile describe the same processes."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.support import REPO_ROOT


@pytest.fixture(scope="module")
def compose() -> dict:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (scripts/bootstrap --dev installs it)")
    result = subprocess.run(["docker-compose", "config"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_file_is_valid_and_has_every_service(compose):
    assert set(compose["services"]) >= {"redis", "api", "cpu-worker", "gpu-worker", "flower"}


def test_compose_redis_keeps_an_append_only_file(compose):
    assert "--appendonly" in compose["services"]["redis"]["command"]


def test_compose_gpu_worker_reserves_an_nvidia_device(compose):
    [device] = compose["services"]["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_compose_cpu_workers_scale_freely(compose):
    worker = compose["services"]["cpu-worker"]
    assert "ports" not in worker and "container_name" not in worker
    assert "-Q preprocess" in " ".join(worker["command"])


def test_procfile_runs_the_same_roles_without_docker():
    roles = dict(line.split(":", 1) for line in (REPO_ROOT / "Procfile").read_text().splitlines() if line)
    assert set(roles) == {"api", "cpu-worker", "gpu-worker", "flower"}
    assert "-Q preprocess" in roles["cpu-worker"] and "--port=5555" in roles["flower"]
