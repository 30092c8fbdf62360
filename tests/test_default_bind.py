"""Where the API listens unless told: on a laptop, `make run` answered anyone on the same network (auth is off
by default), so it binds 127.0.0.1; the container deployments bind every address of their own network on
purpose."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from contract.settings.config import load_settings
from tests.support import REPO_ROOT


def test_the_default_settings_listen_on_this_machine_only(monkeypatch):
    for name in ("IMGSERVE_API__BIND", "IMGSERVE_API_BIND", "IMGSERVE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert load_settings().api.bind == "127.0.0.1:8000"


def test_make_run_binds_loopback_unless_told_otherwise(tmp_path):
    """What scripts/run-local reads (tools.run_settings) and hands gunicorn, and the variable that opens it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMGSERVE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)

    def effective(**more: str) -> dict[str, str]:
        out = subprocess.run(
            [sys.executable, "-m", "tools.run_settings"],
            cwd=tmp_path,  # no .env there: the defaults as a fresh clone has them
            env={**env, **more},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if not line.startswith("export "))

    assert effective()["api_bind"] == "127.0.0.1:8000"
    assert effective()["api_url"] == "http://127.0.0.1:8000"
    assert effective(IMGSERVE_API__BIND="0.0.0.0:8000")["api_bind"] == "0.0.0.0:8000"


def test_the_containers_still_listen_on_their_network():
    app_stage = (REPO_ROOT / "Dockerfile").read_text().split("AS app", 1)[1].split("AS gpu-worker", 1)[0]
    assert "ENV IMGSERVE_API__BIND=0.0.0.0:8000" in app_stage  # `docker run -p 8000:8000` without compose too
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["api"]["environment"]["IMGSERVE_API__BIND"] == "0.0.0.0:8000"
    from tools.kubernetes import render

    objects = render("imgserve:test", "imgserve-gpu:test", "http://prometheus:9090")
    api = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("api"))
    env = api["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "IMGSERVE_API__BIND", "value": "0.0.0.0:8000"} in env
