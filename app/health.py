"""Liveness, readiness and the models the live GPU workers serve."""
from __future__ import annotations

import time
from typing import Any

import redis
from flask import Blueprint, Response, current_app, jsonify

from app.openapi import Reply, operation
from contract.documents import Health, ModelList, Readiness
from contract.heartbeat import Heartbeat

blueprint = Blueprint("health", __name__)


@blueprint.get("/healthz")
@operation("Liveness: the API process answers", tag="health", public=True,
           replies={200: Reply("Alive", Health)})
def healthz() -> Response:
    return jsonify(Health(status="ok").to_json())


@blueprint.get("/readyz")
@operation("Readiness: Redis answers and a GPU worker's heartbeat is fresh", tag="health", public=True,
           replies={200: Reply("Ready", Readiness), 503: Reply("Not ready, and why", Readiness)})
def readyz() -> tuple[Response, int]:
    """Ready when Redis answers and at least one GPU worker's heartbeat is fresh."""
    try:
        workers = live_gpu_workers()
    except redis.RedisError as exc:   # the public detail names the failure, not the Redis host and port
        current_app.logger.warning("readiness: redis unavailable: %s", exc)
        body = Readiness(ready=False, redis=False, detail=f"the job store is unreachable ({type(exc).__name__})",
                         gpu_workers=0)
        return jsonify(body.to_json()), 503
    ready = bool(workers)
    body = Readiness(ready=ready, redis=True, gpu_workers=len(workers),
                     detail="ok" if ready else "no GPU worker heartbeat seen recently")
    return jsonify(body.to_json()), 200 if ready else 503


@blueprint.get("/v1/models")
@operation("The models the live GPU workers serve", tag="models", problems=(503,),
           replies={200: Reply("One entry per model and version, with the workers serving it", ModelList)})
def list_models() -> Response:
    workers = live_gpu_workers()
    models: dict[tuple[str, str], dict[str, Any]] = {}
    for info in workers:
        model = info.model.model_dump()
        entry = models.setdefault((info.model.name, info.model.version), {**model, "devices": [], "workers": []})
        entry["devices"].append(info.model.device)
        entry["workers"].append(info.worker_id)
    for entry in models.values():
        entry.pop("device", None)
    return jsonify(ModelList.model_validate({"models": list(models.values())}).to_json())


def live_gpu_workers() -> list[Heartbeat]:
    """Self-descriptions of GPU workers whose heartbeat has not expired."""
    services = current_app.extensions["imgserve"]
    keys, client = services.keys, services.redis
    ttl = services.settings.gpu_worker.heartbeat_ttl_s
    worker_ids = client.zrangebyscore(keys.gpu_workers, time.time() - ttl, "+inf")
    if not worker_ids:
        return []
    beats = client.mget([keys.heartbeat(w.decode()) for w in worker_ids])
    return [beat for beat in map(Heartbeat.from_redis, beats) if beat is not None]
