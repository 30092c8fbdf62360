"""The Kubernetes manifests (tools/kubernetes.py, issue 61), checked offline: no cluster runs here. Every object
against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field fails), the KEDA ScaledObject
against the fields KEDA's Prometheus scaler requires, and the promises the manifests make: the scaler reads the
gauge the GPU worker exports, one pod's share is its processes, a CPU pod's grace outlasts the longest task."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from contract.settings import CeleryWorkerSettings
from gpu_worker import metrics
from tools.kubernetes import CPU_WANTED_QUERY, KUBERNETES_VERSION, TASK_TIME_LIMIT_S, render

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
