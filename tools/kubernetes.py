"""The service on Kubernetes, rendered by one command:

    python -m tools.kubernetes --image registry.example/imgserve:0.2 --gpu-image registry.example/imgserve-gpu:0.2 \\
        --prometheus http://prometheus.monitoring:9090 > imgserve.yaml
    kubectl create namespace imgserve
    kubectl -n imgserve create secret generic imgserve --from-env-file=imgserve.env   # the secrets (below)
    kubectl -n imgserve apply -f imgserve.yaml

One role a workload, as compose runs them: the API (a Deployment and its Service), the CPU workers (a Deployment
scaled by a KEDA ScaledObject on the product's own signal), the callback workers, Flower, and one GPU worker per
GPU node (a DaemonSet on the nodes that offer `nvidia.com/gpu`). Redis is outside: `IMGSERVE_REDIS_URL` (or
Sentinels, `IMGSERVE_REDIS__SENTINELS`) in the Secret, with `IMGSERVE_CALLBACK_SECRET`, `IMGSERVE_JOB_ID_SECRET`
and `FLOWER_BASIC_AUTH`; it should run with configs/redis.conf's settings, as every deployment here does.

The CPU workers follow `imgserve_cpu_workers_wanted` (contract/workers/scaling.py: the processes a model's backlog and
rate want, every GPU worker exporting the same figure), summed over the models, through KEDA's Prometheus scaler:
replicas = ceil(that sum / each pod's processes), between --min-cpu-pods and --max-cpu-pods. A queue's length
(KEDA's Redis list scaler) would miss what the workers have prefetched or are decoding. A pod told to stop gets
Celery's warm shutdown (it finishes the tasks it runs, gives back what it holds) within its grace period, which is
longer than the longest task (`celery.task_time_limit_s`).

The settings (contract.settings, laid over configs/default.yaml) are a ConfigMap, `--settings FILE` (checked here
as the service reads it), mounted in every pod and named by IMGSERVE_CONFIG; a change rolls the pods (its hash is
on their template). Secrets stay in the Secret. Every pod that serves metrics has a port named `metrics`, and
monitoring/kubernetes-scrape.yml scrapes exactly those ports with the job the alert rules select (the pod's
`app.kubernetes.io/component`: api, gpu-worker). PodDisruptionBudgets let a drain take one API or worker pod at a
time. Nothing here runs a cluster: `python -m tools.kubernetes_check imgserve.yaml` validates the rendered file
offline (Kubernetes' own schemas, strict, and KEDA's ScaledObject against the schema shipped in
tools/kubernetes_schemas/); an object it has no schema for fails.

`--cells N` (N > 1) renders N cells (tools/kubernetes_cells.py, docs/running-cells.md): one API tier knowing every
cell, and per cell its Redis, its workers and its KEDA ScaledObject; the Secret then needs REDIS_PASSWORD.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

import yaml

from contract.settings import CeleryWorkerSettings
from contract.settings.config import load_settings
from contract.settings.sections import SettingsError
from tools.kubernetes_cells import MAX_CELLS, render_cells

CPU_WANTED_QUERY = "sum(max by (model, version) (imgserve_cpu_workers_wanted))"
SECRET = "imgserve"
TASK_TIME_LIMIT_S = CeleryWorkerSettings().task_time_limit_s  # a CPU pod's grace period outlasts the longest task
API_GRACE_S = 45  # longer than gunicorn's graceful_timeout (35 s, configs/gunicorn.conf.py): long-polls answered
KUBERNETES_VERSION = "1.30"  # the schemas the test validates against
SETTINGS = "imgserve-settings"  # the ConfigMap
SETTINGS_DIR, SETTINGS_FILE = "/etc/imgserve", "settings.yaml"
DEFAULT_SETTINGS = (
    "# imgserve's settings, laid over configs/default.yaml (docs/configuration.md); no secrets here\n{}\n"
)
API_METRICS_PORT, GPU_METRICS_PORT = 9101, 9100


def _labels(role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "imgserve", "app.kubernetes.io/component": role}


def _container(name: str, image: str, command: list[str], resources: dict[str, Any], **more: Any) -> dict[str, Any]:
    """A container of the service: the Secret's environment, the settings mounted and named by IMGSERVE_CONFIG."""
    env = [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "IMGSERVE_CONFIG", "value": f"{SETTINGS_DIR}/{SETTINGS_FILE}"},
        *more.pop("env", []),
    ]
    return {
        "name": name,
        "image": image,
        "command": command,
        "envFrom": [{"secretRef": {"name": SECRET}}],
        "env": env,
        "resources": resources,
        "volumeMounts": [{"name": "settings", "mountPath": SETTINGS_DIR, "readOnly": True}],
        **more,
    }


def _resources(cpu: str, memory: str, memory_limit: str, **limits: str) -> dict[str, Any]:
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory_limit, **limits}}


def _pod_template(role: str, spec: dict[str, Any], settings_hash: str, metrics_port: int = 0) -> dict[str, Any]:
    """The pod template: the settings volume; a hash of the settings, so that a change to them rolls the pods;
    and, for a pod that serves metrics, the conventional annotations (monitoring/kubernetes-scrape.yml keeps the
    port named `metrics`)."""
    annotations = {"imgserve/settings-sha256": settings_hash}
    if metrics_port:
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port)})
    volumes = [{"name": "settings", "configMap": {"name": SETTINGS}}]
    return {"metadata": {"labels": _labels(role), "annotations": annotations}, "spec": {**spec, "volumes": volumes}}


def _deployment(
    role: str, container: dict[str, Any], replicas: int, settings_hash: str, grace_s: int = 30, metrics_port: int = 0
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"imgserve-{role}", "labels": _labels(role)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": _labels(role)},
            "template": _pod_template(
                role, {"terminationGracePeriodSeconds": grace_s, "containers": [container]}, settings_hash, metrics_port
            ),
        },
    }


def _disruption_budget(role: str) -> dict[str, Any]:
    """At most one of the role's pods evicted at a time (a drain, a node upgrade): never a budget that blocks a
    drain outright."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"imgserve-{role}", "labels": _labels(role)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(role)}},
    }


def _settings_map(settings_text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": SETTINGS, "labels": _labels("settings")},
        "data": {SETTINGS_FILE: settings_text},
    }


def check_settings(settings_text: str) -> None:
    """Refuse settings the service would refuse at start (an unknown key, a wrong type): SettingsError."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / SETTINGS_FILE
        path.write_text(settings_text)
        load_settings(path)


def _service(role: str, port: int, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"imgserve-{role}", "labels": _labels(role)},
        "spec": {"selector": _labels(role), "ports": [{"name": name, "port": port, "targetPort": port}]},
    }


def render(
    image: str,
    gpu_image: str,
    prometheus: str,
    cpu_processes: int = 4,
    min_cpu_pods: int = 1,
    max_cpu_pods: int = 8,
    api_replicas: int = 2,
    settings_text: str = DEFAULT_SETTINGS,
) -> list[dict[str, Any]]:
    """Every object of the deployment, in apply order; `settings_text` is the settings file the pods read."""
    settings_hash = hashlib.sha256(settings_text.encode()).hexdigest()
    celery = ["celery", "-A", "tasks.worker", "worker", "--loglevel=INFO"]
    api = _container(
        "api",
        image,
        ["gunicorn", "-c", "configs/gunicorn.conf.py", "app:create_app()"],
        # two gunicorn processes (api.workers) and their long-polls
        _resources("1", "1Gi", "2Gi"),
        env=[
            {"name": "IMGSERVE_API__BIND", "value": "0.0.0.0:8000"},
            # /metrics off the public port: every tenant's counts, for Prometheus on 9101 only
            {"name": "IMGSERVE_API__METRICS_PORT", "value": str(API_METRICS_PORT)},
        ],
        ports=[{"containerPort": 8000, "name": "http"}, {"containerPort": API_METRICS_PORT, "name": "metrics"}],
        readinessProbe={"httpGet": {"path": "/readyz", "port": 8000}, "periodSeconds": 5},
        livenessProbe={"httpGet": {"path": "/healthz", "port": 8000}, "periodSeconds": 10},
    )
    cpu = _container(
        "cpu-worker",
        image,
        [
            *celery,
            "-n",
            "cpu@%h",
            "-Q",
            "preprocess",
            f"--concurrency={cpu_processes}",
            "--max-memory-per-child=1048576",
        ],
        _resources(str(cpu_processes), "2Gi", "4Gi"),
    )
    callbacks = _container(
        "callback-worker",
        image,
        [*celery, "-n", "callbacks@%h", "-Q", "callbacks", "-P", "threads", "--concurrency=16"],
        _resources("250m", "256Mi", "512Mi"),  # threads waiting on receivers' answers
    )
    flower = _container(
        "flower",
        image,
        # its credentials from FLOWER_BASIC_AUTH in the Secret, as under make run (never on a command line)
        ["celery", "-A", "tasks.flower", "flower", "--address=0.0.0.0", "--port=5555", "--max_tasks=10000"],
        _resources("100m", "256Mi", "512Mi"),  # the last 10,000 tasks in memory
        ports=[{"containerPort": 5555, "name": "http"}],
    )
    gpu = _container(
        "gpu-worker",
        gpu_image,
        ["python", "-m", "gpu_worker", "--metrics-port", str(GPU_METRICS_PORT), "--metrics-host", "0.0.0.0"],
        _resources("2", "4Gi", "8Gi", **{"nvidia.com/gpu": "1"}),
        ports=[{"containerPort": GPU_METRICS_PORT, "name": "metrics"}],
    )
    gpu_pod = {
        # one GPU worker per GPU node: the nodes the NVIDIA device plugin labels
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": 30,  # it finishes its batch and gives its frames back
        "containers": [gpu],
    }
    gpu_daemons = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "imgserve-gpu-worker", "labels": _labels("gpu-worker")},
        "spec": {
            "selector": {"matchLabels": _labels("gpu-worker")},
            "template": _pod_template("gpu-worker", gpu_pod, settings_hash, GPU_METRICS_PORT),
        },
    }
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "imgserve-cpu-worker", "labels": _labels("cpu-worker")},
        "spec": {
            "scaleTargetRef": {"name": "imgserve-cpu-worker"},
            "minReplicaCount": min_cpu_pods,
            "maxReplicaCount": max_cpu_pods,
            "pollingInterval": 5,
            "cooldownPeriod": 60,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {"stabilizationWindowSeconds": 0},
                        "scaleDown": {"stabilizationWindowSeconds": 60},
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": prometheus,
                        "query": CPU_WANTED_QUERY,
                        "threshold": str(cpu_processes),  # replicas = ceil(wanted processes / a pod's)
                    },
                }
            ],
        },
    }
    grace = TASK_TIME_LIMIT_S + 30
    return [
        _settings_map(settings_text),
        _deployment("api", api, api_replicas, settings_hash, grace_s=API_GRACE_S, metrics_port=API_METRICS_PORT),
        _service("api", 8000, "http"),
        _disruption_budget("api"),
        _deployment("cpu-worker", cpu, min_cpu_pods, settings_hash, grace_s=grace),
        scaled,
        _disruption_budget("cpu-worker"),
        _deployment("callback-worker", callbacks, 1, settings_hash, grace_s=grace),
        _disruption_budget("callback-worker"),
        _deployment("flower", flower, 1, settings_hash),
        _service("flower", 5555, "http"),
        gpu_daemons,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True, help="the service's image (API, CPU and callback workers, Flower)")
    parser.add_argument("--gpu-image", required=True, help="the GPU worker's image (docker-compose.gpu.yml builds one)")
    parser.add_argument("--prometheus", required=True, help="the Prometheus KEDA asks, e.g. http://prometheus:9090")
    parser.add_argument("--cpu-processes", type=int, default=4, help="Celery processes a CPU worker pod runs")
    parser.add_argument("--min-cpu-pods", type=int, default=1)
    parser.add_argument("--max-cpu-pods", type=int, default=8)
    parser.add_argument("--api-replicas", type=int, default=2)
    parser.add_argument(
        "--settings", type=Path, help="the settings file the pods read (the ConfigMap); default: the defaults"
    )
    parser.add_argument(
        "--cells", type=int, default=1, help="cells: per cell a Redis, its workers and a ScaledObject (default 1)"
    )
    parser.add_argument("--redis-image", default="redis:7", help="each cell's Redis (with --cells)")
    parser.add_argument("--redis-storage", default="10Gi", help="each cell's Redis volume (with --cells)")
    args = parser.parse_args(argv)
    if not 1 <= args.cells <= MAX_CELLS:
        print(f"tools.kubernetes: --cells {args.cells}: from 1 to {MAX_CELLS}", file=sys.stderr)
        return 2
    settings_text = args.settings.read_text() if args.settings else DEFAULT_SETTINGS
    try:
        check_settings(settings_text)
    except SettingsError as exc:
        print(f"tools.kubernetes: {args.settings}: {exc}", file=sys.stderr)
        return 2
    objects = render(
        args.image,
        args.gpu_image,
        args.prometheus,
        args.cpu_processes,
        args.min_cpu_pods,
        args.max_cpu_pods,
        args.api_replicas,
        settings_text,
    )
    if args.cells > 1:
        objects = render_cells(objects, args.cells, args.redis_image, args.redis_storage)
    yaml.dump_all(objects, sys.stdout, Dumper=_Dumper, sort_keys=False)
    return 0


class _Dumper(yaml.SafeDumper):
    """The settings file as a block of its own lines in the ConfigMap, as it was written."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


if __name__ == "__main__":
    sys.exit(main())
