"""`python -m tools.kubernetes --cells N`: the deployment as N cells (docs/running-cells.md).

A cell is one control-plane Redis with the workers that serve it. Each cell gets its own set of worker workloads,
named `imgserve-<role>-<cell>` and labelled `imgserve/cell: <cell>`: the CPU workers with their own KEDA
ScaledObject (on the cell's own `imgserve_cpu_workers_wanted`, which monitoring/kubernetes-scrape.yml labels with
the pod's cell), the callback workers, Flower (one a cell: Flower reads one broker) and its Service, the GPU
workers on the GPU nodes labelled for the cell (`kubectl label node NODE imgserve/cell=a`: each GPU node serves
one cell), and the cell's Redis (a StatefulSet with its volume, and a Service). Each cell's pods read
IMGSERVE_REDIS_URL of their cell's Redis, nothing of another's. The API tier stays one Deployment: IMGSERVE_CELLS
names every cell; its own IMGSERVE_REDIS_URL (API keys, rate limits) is still the Secret's.

The Secret then needs REDIS_PASSWORD too: every cell's Redis requires it (written to redis-server on its standard
input, never on a command line), and the URLs that reach them are built from it by Kubernetes' own `$(VAR)`
expansion, so no password is in the manifests.
"""

from __future__ import annotations

import copy
from typing import Any

from tools.cells import cell_names

MAX_CELLS = 16  # the API tier's limit: a job id names its cell in one hex digit
CELL_LABEL = "imgserve/cell"
REDIS_PORT = 6379
SHARED_ROLES = ("settings", "api")  # the API tier's: one for every cell
# As compose's redis: append-only, fsync every second, noeviction under a memory bound, configs/redis.conf's
# settings, the password on stdin.
REDIS_COMMAND = (
    "exec redis-server - --appendonly yes --appendfsync everysec --auto-aof-rewrite-min-size 512mb "
    '--maxmemory "$REDIS_MAXMEMORY" --maxmemory-policy noeviction --hash-max-listpack-entries 0 --dir /data <<EOF\n'
    "requirepass $REDIS_PASSWORD\nEOF\n"
)


def cell_redis_url(cell: str) -> str:
    """The cell's Redis as its pods reach it; $(REDIS_PASSWORD) is expanded by Kubernetes from the Secret."""
    return f"redis://:$(REDIS_PASSWORD)@imgserve-redis-{cell}:{REDIS_PORT}/0"


def cells_setting(cells: list[str]) -> str:
    """IMGSERVE_CELLS for the API: every cell, in YAML flow style (the settings' `cells` list)."""
    entries = ", ".join(f'{{name: {cell}, redis_url: "{cell_redis_url(cell)}"}}' for cell in cells)
    return f"[{entries}]"


def _role(manifest: dict[str, Any]) -> str:
    return str(manifest["metadata"]["labels"]["app.kubernetes.io/component"])


def _for_cell(manifest: dict[str, Any], cell: str) -> dict[str, Any]:
    """One worker object made the cell's: its name, its labels and selector, its pods' Redis, its scaler's query."""
    made = copy.deepcopy(manifest)
    role = _role(made)
    made["metadata"]["name"] = f"imgserve-{role}-{cell}"
    made["metadata"]["labels"][CELL_LABEL] = cell
    spec = made["spec"]
    for labels in (spec.get("selector", {}).get("matchLabels"), spec.get("selector")):
        if isinstance(labels, dict) and "app.kubernetes.io/component" in labels:
            labels[CELL_LABEL] = cell
    if "template" in spec:
        pod = spec["template"]
        pod["metadata"]["labels"][CELL_LABEL] = cell
        for container in pod["spec"]["containers"]:
            # env wins over envFrom: the Secret's IMGSERVE_REDIS_URL (the API tier's) is replaced by the cell's
            container["env"].append({"name": "IMGSERVE_REDIS_URL", "value": cell_redis_url(cell)})
        if made["kind"] == "DaemonSet":  # the GPU nodes labelled for this cell
            pod["spec"]["nodeSelector"][CELL_LABEL] = cell
    if made["kind"] == "ScaledObject":
        spec["scaleTargetRef"]["name"] = f"{spec['scaleTargetRef']['name']}-{cell}"
        for trigger in spec["triggers"]:
            query = trigger["metadata"]["query"]
            trigger["metadata"]["query"] = query.replace(
                "imgserve_cpu_workers_wanted", f'imgserve_cpu_workers_wanted{{cell="{cell}"}}'
            )
    return made


def _redis(cell: str, image: str, storage: str) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/name": "imgserve", "app.kubernetes.io/component": "redis", CELL_LABEL: cell}
    name = f"imgserve-redis-{cell}"
    container = {
        "name": "redis",
        "image": image,
        "command": ["sh", "-c", REDIS_COMMAND],
        "env": [
            {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "imgserve", "key": "REDIS_PASSWORD"}}},
            {"name": "REDIS_MAXMEMORY", "value": "1gb"},
        ],
        "ports": [{"containerPort": REDIS_PORT, "name": "redis"}],
        "resources": {"requests": {"cpu": "1", "memory": "1536Mi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    stateful = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}},
                }
            ],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"selector": labels, "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": REDIS_PORT}]},
    }
    return [stateful, service]


def render_cells(
    objects: list[dict[str, Any]], count: int, redis_image: str = "redis:7", redis_storage: str = "10Gi"
) -> list[dict[str, Any]]:
    """The single-cell deployment's objects (tools.kubernetes.render) as `count` cells: the API tier once, with
    IMGSERVE_CELLS, then each cell's Redis and workers."""
    cells = cell_names(count, most=MAX_CELLS)
    shared = [copy.deepcopy(o) for o in objects if _role(o) in SHARED_ROLES]
    for manifest in shared:
        if manifest["kind"] == "Deployment":
            for container in manifest["spec"]["template"]["spec"]["containers"]:
                container["env"].append({"name": "IMGSERVE_CELLS", "value": cells_setting(cells)})
    rendered = shared
    for cell in cells:
        rendered += _redis(cell, redis_image, redis_storage)
        rendered += [_for_cell(o, cell) for o in objects if _role(o) not in SHARED_ROLES]
    return rendered
