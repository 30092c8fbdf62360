"""The service on Kubernetes, rendered by one command (issue 61):

    python -m tools.kubernetes --image registry.example/imgserve:0.2 --gpu-image registry.example/imgserve-gpu:0.2 \\
        --prometheus http://prometheus.monitoring:9090 > imgserve.yaml
    kubectl create namespace imgserve
    kubectl -n imgserve create secret generic imgserve --from-env-file=imgserve.env   # the secrets (below)
    kubectl -n imgserve apply -f imgserve.yaml

One role a workload, as compose runs them: the API (a Deployment and its Service), the CPU workers (a Deployment
scaled by a KEDA ScaledObject on the product's own signal), the callback workers, Flower, and one GPU worker per
GPU node (a DaemonSet on the nodes that offer `nvidia.com/gpu`). Redis is outside: `IMGSERVE_REDIS_URL` (or
Sentinels, `IMGSERVE_REDIS__SENTINELS`) in the Secret, with `IMGSERVE_CALLBACK_SECRET`, `IMGSERVE_JOB_ID_SECRET`
and `FLOWER_BASIC_AUTH`.

The CPU workers follow `imgserve_cpu_workers_wanted` (contract/scaling.py: the processes a model's backlog and rate
want, every GPU worker exporting the same figure), summed over the models, through KEDA's Prometheus scaler:
replicas = ceil(that sum / each pod's processes), between --min-cpu-pods and --max-cpu-pods. A queue's length
(KEDA's Redis list scaler) would miss what the workers have prefetched or are decoding. A pod told to stop gets
Celery's warm shutdown (it finishes the tasks it runs, gives back what it holds) within its grace period, which is
longer than the longest task (`celery.task_time_limit_s`).

Nothing here runs a cluster: tests/test_kubernetes.py validates every object offline against Kubernetes' own
schemas (kubernetes-validate) and the ScaledObject against the fields KEDA requires.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from contract.settings import CeleryWorkerSettings

CPU_WANTED_QUERY = "sum(max by (model, version) (imgserve_cpu_workers_wanted))"
SECRET = "imgserve"
TASK_TIME_LIMIT_S = CeleryWorkerSettings().task_time_limit_s  # a CPU pod's grace period outlasts the longest task
API_GRACE_S = 45  # longer than gunicorn's graceful_timeout (35 s, configs/gunicorn.conf.py): long-polls answered
KUBERNETES_VERSION = "1.30"  # the schemas the test validates against


def _labels(role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "imgserve", "app.kubernetes.io/component": role}


def _container(name: str, image: str, command: list[str], **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "command": command,
        "envFrom": [{"secretRef": {"name": SECRET}}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        **more,
    }


def _deployment(role: str, container: dict[str, Any], replicas: int, grace_s: int = 30) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"imgserve-{role}", "labels": _labels(role)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": _labels(role)},
            "template": {
                "metadata": {"labels": _labels(role)},
                "spec": {"terminationGracePeriodSeconds": grace_s, "containers": [container]},
            },
        },
    }


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
) -> list[dict[str, Any]]:
    """Every object of the deployment, in apply order."""
    celery = ["celery", "-A", "tasks.worker", "worker", "--loglevel=INFO"]
    api = _container(
        "api",
        image,
        ["gunicorn", "-c", "configs/gunicorn.conf.py", "app:create_app()"],
        env=[
            {"name": "IMGSERVE_API__BIND", "value": "0.0.0.0:8000"},
            # /metrics off the public port: every tenant's counts, for Prometheus on 9101 only
            {"name": "IMGSERVE_API__METRICS_PORT", "value": "9101"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        ports=[{"containerPort": 8000, "name": "http"}, {"containerPort": 9101, "name": "metrics"}],
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
        resources={"requests": {"cpu": str(cpu_processes), "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
    )
    callbacks = _container(
        "callback-worker",
        image,
        [*celery, "-n", "callbacks@%h", "-Q", "callbacks", "-P", "threads", "--concurrency=16"],
    )
    flower = _container(
        "flower",
        image,
        # its credentials from FLOWER_BASIC_AUTH in the Secret, as under make run (never on a command line)
        ["celery", "-A", "tasks.flower", "flower", "--address=0.0.0.0", "--port=5555", "--max_tasks=10000"],
        ports=[{"containerPort": 5555, "name": "http"}],
    )
    gpu = _container(
        "gpu-worker",
        gpu_image,
        ["python", "-m", "gpu_worker", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"],
        ports=[{"containerPort": 9100, "name": "metrics"}],
        resources={"limits": {"nvidia.com/gpu": "1"}},
    )
    gpu_daemons = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "imgserve-gpu-worker", "labels": _labels("gpu-worker")},
        "spec": {
            "selector": {"matchLabels": _labels("gpu-worker")},
            "template": {
                "metadata": {
                    "labels": _labels("gpu-worker"),
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "9100"},
                },
                "spec": {
                    # one GPU worker per GPU node: the nodes the NVIDIA device plugin labels
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "terminationGracePeriodSeconds": 30,  # it finishes its batch and gives its frames back
                    "containers": [gpu],
                },
            },
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
        _deployment("api", api, api_replicas, grace_s=API_GRACE_S),
        _service("api", 8000, "http"),
        _deployment("cpu-worker", cpu, min_cpu_pods, grace_s=grace),
        scaled,
        _deployment("callback-worker", callbacks, 1, grace_s=grace),
        _deployment("flower", flower, 1),
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
    args = parser.parse_args(argv)
    objects = render(
        args.image,
        args.gpu_image,
        args.prometheus,
        args.cpu_processes,
        args.min_cpu_pods,
        args.max_cpu_pods,
        args.api_replicas,
    )
    yaml.safe_dump_all(objects, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
