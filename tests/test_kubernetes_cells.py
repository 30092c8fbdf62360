"""`python -m tools.kubernetes --cells N` (tools/kubernetes_cells.py), checked offline as tests/test_kubernetes.py
checks one cell's: every object valid; each cell's workloads, ScaledObject and Redis its own, its pods pointed at
its Redis alone; the API knowing every cell; each cell's metrics labelled with its cell by the shipped scrape job."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import yaml

from tests.test_kubernetes import CPU_WANTED_QUERY, OBJECTS, REPO_ROOT, relabelled_targets
from tools import kubernetes_check
from tools.cells import read_cells_setting
from tools.kubernetes_cells import CELL_LABEL, render_cells

CELLS = render_cells(OBJECTS, 3)
WORKER_ROLES = {"cpu-worker", "callback-worker", "flower", "gpu-worker", "redis"}


def containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return manifest["spec"]["template"]["spec"]["containers"] if "template" in manifest["spec"] else []


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {entry["name"]: entry.get("value", entry.get("valueFrom")) for entry in container.get("env", [])}


def test_every_object_passes_the_offline_check():
    assert kubernetes_check.check(CELLS) == []


def test_each_cell_has_its_own_workloads_redis_and_scaled_object():
    for cell in ("a", "b", "c"):
        mine = [o for o in CELLS if o["metadata"]["labels"].get(CELL_LABEL) == cell]
        roles = {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in mine}
        assert roles == WORKER_ROLES, cell
        assert all(o["metadata"]["name"].endswith(f"-{cell}") for o in mine)
        for manifest in mine:
            selector = manifest["spec"].get("selector", {})
            labels = selector.get("matchLabels", selector)
            if labels:  # a cell's selector picks its own pods only, never another cell's of the same role
                assert labels[CELL_LABEL] == cell, manifest["metadata"]["name"]
        [scaled] = [o for o in mine if o["kind"] == "ScaledObject"]
        assert scaled["spec"]["scaleTargetRef"]["name"] == f"imgserve-cpu-worker-{cell}"
        [trigger] = scaled["spec"]["triggers"]
        assert f'imgserve_cpu_workers_wanted{{cell="{cell}"}}' in trigger["metadata"]["query"]
        [gpu] = [o for o in mine if o["kind"] == "DaemonSet"]
        assert gpu["spec"]["template"]["spec"]["nodeSelector"][CELL_LABEL] == cell


def test_each_cells_pods_reach_their_cells_redis_alone():
    for manifest in CELLS:
        cell = manifest["metadata"]["labels"].get(CELL_LABEL)
        if cell is None or manifest["metadata"]["labels"]["app.kubernetes.io/component"] == "redis":
            continue
        for container in containers(manifest):
            url = env_of(container)["IMGSERVE_REDIS_URL"]
            assert url == f"redis://:$(REDIS_PASSWORD)@imgserve-redis-{cell}:6379/0", manifest["metadata"]["name"]
            assert "IMGSERVE_CELLS" not in env_of(container)
            # env wins over envFrom: the Secret's IMGSERVE_REDIS_URL (the API tier's) does not reach the cell's pods
            assert container["envFrom"] == [{"secretRef": {"name": "imgserve"}}]


def test_the_api_knows_every_cell_by_its_redis_service():
    [api] = [o for o in CELLS if o["kind"] == "Deployment" and o["metadata"]["name"] == "imgserve-api"]
    [container] = containers(api)
    cells = read_cells_setting(env_of(container)["IMGSERVE_CELLS"])
    services = {o["metadata"]["name"] for o in CELLS if o["kind"] == "Service"}
    assert [entry["name"] for entry in cells] == ["a", "b", "c"]
    for entry in cells:
        host = str(entry["redis_url"]).split("@")[1].split(":")[0]
        assert host in services
    assert "IMGSERVE_REDIS_URL" not in env_of(container)  # the tier's own Redis: the Secret's, as with one cell


def test_each_cells_redis_keeps_its_password_off_the_command_line_and_its_data_on_a_volume():
    for manifest in (o for o in CELLS if o["kind"] == "StatefulSet"):
        [container] = containers(manifest)
        command = " ".join(container["command"])
        assert "requirepass $REDIS_PASSWORD" in command and "<<EOF" in command  # on stdin, not in argv
        assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
        assert env_of(container)["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "imgserve", "key": "REDIS_PASSWORD"}}
        assert manifest["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_the_scrape_job_labels_each_cells_targets_with_its_cell(tmp_path):
    active = relabelled_targets(CELLS, tmp_path)
    by_cell = {(t["labels"]["job"], t["labels"].get("cell")) for t in active}
    assert by_cell == {("api", None), *(("gpu-worker", cell) for cell in "abc")}
    assert CPU_WANTED_QUERY.replace("imgserve_cpu_workers_wanted", 'imgserve_cpu_workers_wanted{cell="a"}') in str(
        CELLS
    )


def test_the_command_renders_cells_that_the_offline_check_passes(tmp_path):
    rendered = tmp_path / "imgserve.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "tools.kubernetes", "--image", "i:1", "--gpu-image", "g:1"]
        + ["--prometheus", "http://p", "--cells", "2"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rendered.write_text(done.stdout)
    assert sum(o["kind"] == "ScaledObject" for o in yaml.safe_load_all(done.stdout)) == 2
    checked = subprocess.run(
        [sys.executable, "-m", "tools.kubernetes_check", str(rendered)], cwd=REPO_ROOT, capture_output=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "tools.kubernetes", "--image", "i", "--gpu-image", "g", "--prometheus", "p"]
        + ["--cells", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--cells 0: from 1 to 16" in refused.stderr
