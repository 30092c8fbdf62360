"""Liveness, readiness and the models the live GPU workers serve."""

from __future__ import annotations

from typing import Any

import redis
from flask import Blueprint, Response, current_app, jsonify

from app.auth import is_admin
from app.openapi import Reply, operation
from app.services import services as current_services
from contract.documents.status_documents import Health, ModelList, Readiness
from contract.jobs.backlog import queue_depths
from contract.workers.heartbeat import Heartbeat, live_heartbeats

blueprint = Blueprint("health", __name__)


@blueprint.get("/healthz")
@operation("Liveness: the API process answers", tag="health", public=True, replies={200: Reply("Alive", Health)})
def healthz() -> Response:
    return jsonify(Health(status="ok").to_json())


@blueprint.get("/readyz")
@operation(
    "Readiness: Redis answers and a GPU worker's heartbeat is fresh",
    tag="health",
    public=True,
    replies={200: Reply("Ready", Readiness), 503: Reply("Not ready, and why", Readiness)},
)
def readyz() -> tuple[Response, int]:
    """Ready when Redis answers and at least one GPU worker's heartbeat is fresh."""
    try:
        workers = live_gpu_workers()
    except redis.RedisError as exc:  # the public detail names the failure, not the Redis host and port
        current_app.logger.warning("readiness: redis unavailable: %s", exc)
        body = Readiness(
            ready=False, redis=False, detail=f"the job store is unreachable ({type(exc).__name__})", gpu_workers=0
        )
        return jsonify(body.to_json()), 503
    ready = bool(workers)
    body = Readiness(
        ready=ready,
        redis=True,
        gpu_workers=len(workers),
        detail="ok" if ready else "no GPU worker heartbeat seen recently",
    )
    return jsonify(body.to_json()), 200 if ready else 503


@blueprint.get("/v1/models")
@operation(
    "The models this deployment serves: each version, its routing, workers, queue and p95 (those two, with API "
    "keys, to an admin key only)",
    tag="models",
    problems=(503,),
    replies={200: Reply("One entry per model version, and per name how `model=name` is split", ModelList)},
)
def list_models() -> Response:
    services = current_services()
    catalogue = services.catalogue
    workers = live_gpu_workers()
    # The queues, the p95 and the jobs answered are every tenant's traffic: an admin key's figures (as /v1/stats).
    everyones = is_admin(services.settings.auth.api_keys)
    depths = _depths(list(catalogue.specs))
    versions: list[dict[str, Any]] = []
    for spec in catalogue:
        served = [(info, model) for info in workers for model in info.served_models() if model.key == spec.key]
        entry: dict[str, Any] = {**spec.describe(), "format": spec.format}
        if served:  # what a worker says about the loaded model (precision, output, simulated, ...)
            entry.update({k: v for k, v in served[0][1].model_dump().items() if k not in ("device", "stats")})
        p95s = [float(model.stats["p95_ms"]) for _, model in served if model.stats.get("p95_ms") is not None]
        weights = catalogue.weights(spec.name)
        entry.update(
            {
                "state": "draining" if spec.key in catalogue.draining else "serving",
                "default": spec.key == catalogue.default.key,
                "share": round(weights.get(spec.version, 0.0) / sum(weights.values()), 4) if weights else 0.0,
                "workers": [info.worker_id for info, _ in served],
                "devices": [model.device for _, model in served],
                "queue": depths[spec.key] if everyones else None,
                "p95_ms": max(p95s) if p95s and everyones else None,
                "recent_jobs": sum(int(model.stats.get("jobs", 0)) for _, model in served) if everyones else None,
            }
        )
        versions.append(entry)
    names = {
        spec.name: {
            "name": spec.name,
            "versions": [s.version for s in catalogue if s.name == spec.name],
            "routes": catalogue.weights(spec.name),
        }
        for spec in catalogue
    }
    return jsonify(ModelList.model_validate({"models": versions, "names": list(names.values())}).to_json())


def _depths(model_keys: list[str]) -> dict[str, dict[str, int]]:
    """Per model, its queues over every cell (with several, those that answer; an error when none does)."""
    services = current_services()
    tenants = services.settings.tenants
    if len(services.cells) == 1:
        return queue_depths(services.redis, services.keys, model_keys, tenants)
    found, failures = [], []
    for cell in services.cells:
        try:
            found.append(queue_depths(cell.redis, cell.keys, model_keys, tenants))
        except redis.RedisError as exc:
            failures.append(exc)
    if not found:
        raise failures[0]
    return {
        key: {part: sum(depths[key][part] for depths in found) for part in ("preprocess", "frames")}
        for key in model_keys
    }


def live_gpu_workers() -> list[Heartbeat]:
    """Self-descriptions of GPU workers whose heartbeat has not expired, in every cell (docs/cells.md): with
    several, the cells that answer (an error only when none does)."""
    services = current_services()
    ttl_s = services.settings.gpu_worker.heartbeat_ttl_s
    if len(services.cells) == 1:
        return live_heartbeats(services.redis, services.keys, ttl_s)
    workers, failures = [], []
    for cell in services.cells:
        try:
            workers += live_heartbeats(cell.redis, cell.keys, ttl_s)
        except redis.RedisError as exc:
            failures.append(exc)
    if failures and len(failures) == len(services.cells):
        raise failures[0]
    return workers
