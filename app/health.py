"""Liveness, readiness and the models the live GPU workers serve."""
from __future__ import annotations

import json
import time
from typing import Any

import redis
from flask import Blueprint, Response, current_app, jsonify

blueprint = Blueprint("health", __name__)


@blueprint.get("/healthz")
def healthz() -> Response:
    return jsonify({"status": "ok"})


@blueprint.get("/readyz")
def readyz() -> tuple[Response, int]:
    """Ready when Redis answers and at least one GPU worker's heartbeat is fresh."""
    try:
        workers = live_gpu_workers()
    except redis.RedisError as exc:
        return jsonify({"ready": False, "redis": False, "detail": str(exc), "gpu_workers": 0}), 503
    ready = bool(workers)
    body = {"ready": ready, "redis": True, "gpu_workers": len(workers),
            "detail": "ok" if ready else "no GPU worker heartbeat seen recently"}
    return jsonify(body), 200 if ready else 503


@blueprint.get("/v1/models")
def list_models() -> Response:
    workers = live_gpu_workers()
    models: dict[tuple[str, str], dict[str, Any]] = {}
    for info in workers:
        model = info["model"]
        entry = models.setdefault((model["name"], model["version"]), {**model, "devices": [], "workers": []})
        entry["devices"].append(model["device"])
        entry["workers"].append(info["worker_id"])
    for entry in models.values():
        entry.pop("device", None)
    return jsonify({"models": list(models.values())})


def live_gpu_workers() -> list[dict[str, Any]]:
    """Self-descriptions of GPU workers whose heartbeat has not expired."""
    services = current_app.extensions["imgserve"]
    keys, client = services.keys, services.redis
    ttl = services.settings.gpu_worker.heartbeat_ttl_s
    worker_ids = client.zrangebyscore(keys.gpu_workers, time.time() - ttl, "+inf")
    if not worker_ids:
        return []
    beats = client.mget([keys.heartbeat(w.decode()) for w in worker_ids])
    return [json.loads(beat) for beat in beats if beat]
