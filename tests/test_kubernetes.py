"""The Kubernetes manifests (tools/kubernetes.py, issue 61), checked offline: no cluster runs here. Every object
against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field fails), the KEDA ScaledObject
against the fields KEDA's Prometheus scaler requires, and the promises the manifests make: the scaler reads the
gauge the GPU worker exports, one pod's share is its processes, a CPU pod's grace outlasts the longest task."""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import requests
import yaml

from bench.stack.processes import ManagedProcess, free_port, wait_until
from contract.settings import CeleryWorkerSettings
from gpu_worker import metrics
from tools import kubernetes_check
from tools.kubernetes import (
    CPU_WANTED_QUERY,
    KUBERNETES_VERSION,
    SETTINGS,
    SETTINGS_FILE,
    TASK_TIME_LIMIT_S,
    render,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
OBJECTS = render("registry.example/imgserve:1", "registry.example/imgserve-gpu:1", "http://prometheus:9090")


@pytest.mark.parametrize("manifest", [o for o in OBJECTS if o["kind"] != "ScaledObject"], ids=lambda o: o["kind"])
def test_each_object_is_valid_against_the_kubernetes_schema(manifest):
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_the_scaled_object_has_what_kedas_prometheus_scaler_requires_and_reads_the_exported_gauge():
    [scaled] = [o for o in OBJECTS if o["kind"] == "ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    names = {o["metadata"]["name"] for o in OBJECTS if o["kind"] == "Deployment"}
    assert spec["scaleTargetRef"]["name"] in names
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) >= {"serverAddress", "query", "threshold"}
    assert all(isinstance(value, str) for value in trigger["metadata"].values())  # KEDA's metadata is strings
    assert metrics.CPU_WORKERS_WANTED._name in CPU_WANTED_QUERY  # the gauge the GPU workers export
    [cpu] = [
        o for o in OBJECTS if o["kind"] == "Deployment" and o["metadata"]["name"] == spec["scaleTargetRef"]["name"]
    ]
    command = cpu["spec"]["template"]["spec"]["containers"][0]["command"]
    processes = int(next(word for word in command if word.startswith("--concurrency=")).split("=")[1])
    assert trigger["metadata"]["threshold"] == str(processes)  # replicas = ceil(wanted processes / a pod's)


def test_a_cpu_pod_told_to_stop_has_longer_than_its_longest_task_to_finish():
    """Celery's warm shutdown on SIGTERM finishes what runs: the grace period outlasts celery.task_time_limit_s."""
    assert TASK_TIME_LIMIT_S == CeleryWorkerSettings().task_time_limit_s
    for manifest in OBJECTS:
        if manifest["metadata"]["name"] in ("imgserve-cpu-worker", "imgserve-callback-worker"):
            if manifest["kind"] == "Deployment":
                assert manifest["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > TASK_TIME_LIMIT_S


def test_one_gpu_worker_runs_per_gpu_node_and_no_secret_is_in_the_manifests():
    [gpu] = [o for o in OBJECTS if o["kind"] == "DaemonSet"]
    container = gpu["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    text = yaml.safe_dump_all(OBJECTS)
    assert "FLOWER_BASIC_AUTH" not in text and "password" not in text.lower()  # from the Secret, by envFrom
    assert all(
        c["envFrom"] == [{"secretRef": {"name": "imgserve"}}]
        for o in OBJECTS
        if o["kind"] in ("Deployment", "DaemonSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    )


def test_one_command_renders_them():
    done = subprocess.run(
        [sys.executable, "-m", "tools.kubernetes", "--image", "i:1", "--gpu-image", "g:1", "--prometheus", "http://p"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert [o["kind"] for o in yaml.safe_load_all(done.stdout)] == [o["kind"] for o in OBJECTS]


def _pods(objects: list[dict[str, Any]] = OBJECTS) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod template) of every Deployment, DaemonSet and StatefulSet."""
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def test_validation_cannot_pass_a_scaled_object_unchecked():
    """kubernetes-validate has no schema for KEDA's object (its own command says "Couldn't find schema" and exits
    0); the check names it a failure unless a schema ships for it."""
    [scaled] = [o for o in OBJECTS if o["kind"] == "ScaledObject"]
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(scaled, KUBERNETES_VERSION, strict=True)
    assert kubernetes_check.problems(scaled) == []
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    [problem] = kubernetes_check.problems(widget)
    assert "no schema" in problem


@pytest.mark.parametrize(
    "where, wrong",
    [
        ("spec", {"pollingIntervall": 5}),  # a misspelt field
        ("spec", {"minReplicaCount": "1"}),  # a string where KEDA takes an integer
        ("trigger", {"treshold": "4"}),  # the Prometheus scaler's key misspelt
        ("trigger", {"threshold": 4}),  # KEDA's metadata values are strings
        ("scaleTargetRef", {"nmae": "imgserve-cpu-worker"}),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else value,
)
def test_the_offline_check_refuses_a_wrong_scaled_object_field(where, wrong):
    objects = copy.deepcopy(OBJECTS)
    [scaled] = [o for o in objects if o["kind"] == "ScaledObject"]
    if where == "trigger":
        metadata = scaled["spec"]["triggers"][0]["metadata"]
        metadata.pop("threshold")
        metadata.update(wrong)
    else:
        (scaled["spec"] if where == "spec" else scaled["spec"]["scaleTargetRef"]).update(wrong)
    failures = kubernetes_check.check(objects)
    assert failures and all(failure.startswith("ScaledObject/imgserve-cpu-worker") for failure in failures)
    assert any(next(iter(wrong)) in failure for failure in failures), failures


def test_the_offline_check_command_exits_non_zero_naming_a_wrong_field_and_an_object_it_has_no_schema_for(tmp_path):
    objects = copy.deepcopy(OBJECTS)
    [scaled] = [o for o in objects if o["kind"] == "ScaledObject"]
    scaled["spec"]["pollingIntervall"] = scaled["spec"].pop("pollingInterval")
    rendered = tmp_path / "imgserve.yaml"
    rendered.write_text(yaml.safe_dump_all([*objects, {"apiVersion": "example.com/v1", "kind": "Widget"}]))
    done = _check(rendered)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pollingIntervall" in done.stderr and "Widget" in done.stderr and "no schema" in done.stderr, done.stderr
    assert kubernetes_check.check([]) == ["no objects to validate"]


def test_the_validation_command_of_the_docs_passes_what_the_render_command_of_the_docs_makes(tmp_path):
    """The block of docs/deployment.md a user runs, as written (with this interpreter for .venv/bin/python), in a
    folder of its own: it renders, then validates every object offline."""
    page = (REPO_ROOT / "docs" / "deployment.md").read_text()
    [block] = [b for b in re.findall(r"```bash\n(.*?)```", page, re.S) if "tools.kubernetes_check" in b]
    assert "tools.kubernetes " in block
    script = block.replace(".venv/bin/python", shlex.quote(sys.executable))
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(OBJECTS)} objects valid" in done.stdout


def _check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.kubernetes_check", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_container_requests_cpu_and_memory_and_has_a_memory_limit():
    for workload, template in _pods():
        for container in template["spec"]["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= resources["requests"].keys(), (workload["metadata"]["name"], resources)
            assert "memory" in resources["limits"], (workload["metadata"]["name"], resources)


def test_a_drain_takes_one_api_or_worker_pod_at_a_time_and_is_never_blocked():
    budgets = {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == "PodDisruptionBudget"}
    for name in ("imgserve-api", "imgserve-cpu-worker", "imgserve-callback-worker"):
        [workload] = [o for o in OBJECTS if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
        budget = budgets[name]
        assert (
            budget["spec"]["selector"]["matchLabels"].items()
            <= workload["spec"]["template"]["metadata"]["labels"].items()
        )
        assert budget["spec"]["maxUnavailable"] == 1 and "minAvailable" not in budget["spec"]


def test_every_pod_reads_the_settings_of_the_config_map_and_rolls_when_they_change(tmp_path):
    settings = "api:\n  workers: 3\n"
    objects = render("i:1", "g:1", "http://p", settings_text=settings)
    [config] = [o for o in objects if o["kind"] == "ConfigMap"]
    assert config["metadata"]["name"] == SETTINGS and config["data"] == {SETTINGS_FILE: settings}
    hashes = set()
    for workload in [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]:
        pod = workload["spec"]["template"]
        [volume] = [v for v in pod["spec"]["volumes"] if v.get("configMap", {}).get("name") == SETTINGS]
        for container in pod["spec"]["containers"]:
            [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env["IMGSERVE_CONFIG"] == f"{mount['mountPath']}/{SETTINGS_FILE}", workload["metadata"]["name"]
        hashes.add(pod["metadata"]["annotations"]["imgserve/settings-sha256"])
    [default_hash] = {
        o["spec"]["template"]["metadata"]["annotations"]["imgserve/settings-sha256"]
        for o in OBJECTS
        if o["kind"] in ("Deployment", "DaemonSet")
    }
    assert len(hashes) == 1 and default_hash not in hashes  # a change to the settings rolls every pod

    mine = tmp_path / "settings.yaml"
    mine.write_text(settings)
    rendered = _render("--settings", str(mine))
    assert rendered.returncode == 0, rendered.stderr
    assert next(o for o in yaml.safe_load_all(rendered.stdout) if o["kind"] == "ConfigMap")["data"] == config["data"]
    mine.write_text("api:\n  wrkers: 3\n")  # a key the service refuses at start is refused here
    refused = _render("--settings", str(mine))
    assert refused.returncode != 0 and "wrkers" in refused.stderr and not refused.stdout


def _render(*more: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.kubernetes", "--image", "i:1", "--gpu-image", "g:1", "--prometheus", "http://p"]
        + list(more),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def relabelled_targets(objects: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    """A real Prometheus applies the shipped scrape job's relabelling (monitoring/kubernetes-scrape.yml) to the
    targets Kubernetes' pod discovery would give for the rendered pods (one per container port, with the pod's
    labels and annotations as __meta_kubernetes_* labels; Debian's Prometheus is built without Kubernetes
    discovery, so they come as static targets): its active targets."""
    shipped = yaml.safe_load((REPO_ROOT / "monitoring" / "kubernetes-scrape.yml").read_text())
    [job] = shipped["scrape_configs"]
    targets = []
    for workload, pod in _pods(objects):
        meta = {
            "__meta_kubernetes_namespace": "imgserve",
            "__meta_kubernetes_pod_name": f"{workload['metadata']['name']}-0",
            **{f"__meta_kubernetes_pod_label_{_sanitised(k)}": v for k, v in pod["metadata"]["labels"].items()},
            **{
                f"__meta_kubernetes_pod_annotation_{_sanitised(k)}": v
                for k, v in pod["metadata"].get("annotations", {}).items()
            },
        }
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                labels = {
                    **meta,
                    "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port["name"],
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                }
                # nothing listens there: the targets' labels are what is checked, not a scrape
                targets.append({"targets": [f"127.0.0.1:{free_port()}"], "labels": labels})
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1h"},
                "scrape_configs": [
                    {"job_name": job["job_name"], "static_configs": targets, "relabel_configs": job["relabel_configs"]}
                ],
            }
        )
    )
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: scripts/bootstrap --dev installs Debian's prometheus package, which has it"
    port = free_port()
    prometheus = ManagedProcess(
        "prometheus",
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        dict(os.environ),
        tmp_path,
    )
    try:
        answer: dict[str, Any] = {}

        def all_targets_seen() -> bool:
            assert prometheus.alive(), prometheus.log_tail()
            try:
                answer.update(requests.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).json()["data"])
            except (requests.RequestException, ValueError, KeyError):
                return False
            return len(answer["activeTargets"]) + len(answer["droppedTargets"]) == len(targets)

        wait_until(all_targets_seen, 60, what="Prometheus to apply the scrape job to every target")
    finally:
        prometheus.stop()
    return list(answer["activeTargets"])


def test_every_pod_that_serves_metrics_is_scraped_with_the_job_the_alert_rules_select(tmp_path):
    """Every metrics port is kept, under the job the rules select."""
    active = relabelled_targets(OBJECTS, tmp_path)
    scraped = {
        (t["labels"]["job"], t["discoveredLabels"]["__meta_kubernetes_pod_container_port_number"]) for t in active
    }
    assert scraped == {("api", "9101"), ("gpu-worker", "9100")}
    assert all(t["labels"]["instance"].startswith("imgserve/imgserve-") for t in active)
    assert not any("cell" in t["labels"] for t in active)  # one cell's deployment: no cell label
    rules = (REPO_ROOT / "monitoring" / "alerts" / "imgserve.rules.yml").read_text()
    [selected] = re.findall(r'job=~"([^"]+)"', rules)
    compose_jobs = {
        c["job_name"]
        for c in yaml.safe_load((REPO_ROOT / "monitoring" / "prometheus.yml").read_text())["scrape_configs"]
    }
    assert {job for job, _ in scraped} == set(selected.split("|")) == compose_jobs


def _sanitised(name: str) -> str:
    """A Kubernetes label or annotation name as Prometheus's discovery names its meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)
