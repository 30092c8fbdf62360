"""`GET /v1/stats`: a JSON summary of queues, GPU workers, the time bill and the result cache."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from app.auth import require_admin
from app.cell_stats import cells_document, merged_backlogs, read_cell
from app.openapi import Reply, operation
from app.services import services as current_services
from contract.documents.status_documents import Stats
from contract.jobs.backlog import total_depths
from contract.redis.clock import now as service_now
from contract.workers.heartbeat import Heartbeat
from contract.workers.scaling import scaling_signal, windows_of

blueprint = Blueprint("stats", __name__)


@blueprint.get("/v1/stats")
@operation(
    "Queues, GPU busy fraction, batch sizes and the recent time bill",
    tag="stats",
    problems=((403, "API keys are configured and this one is not an admin key"), 503),
    replies={200: Reply("A summary over each GPU worker's recent window", Stats)},
)
def stats() -> Response:
    services = current_services()
    require_admin(services.settings.auth.api_keys)
    model_keys = list(services.catalogue.specs)
    # Each cell read on its own (app.cell_stats): with several, one that does not answer is `unavailable`.
    readings = [read_cell(cell, model_keys, several=len(services.cells) > 1) for cell in services.cells]
    workers = [worker for reading in readings for worker in reading.workers]
    found = merged_backlogs(readings, model_keys)
    depths = {key: {"preprocess": backlog.queued, "frames": backlog.frames} for key, backlog in found.items()}
    windows = windows_of(workers, service_now())
    answering = next((reading.cell for reading in readings if reading.up), services.cells.first)
    summary = Stats.model_validate(
        {
            "scaling": {
                key: scaling_signal(found[key], windows.get(key, []), services.settings.scaling).to_json()
                for key in model_keys
            },
            "cache": answering.cache.stats(model_keys),  # each cell keeps its own: the first that answers
            "queues": total_depths(depths),
            "queues_by_model": depths,
            "gpu_workers": [
                {"worker_id": w.worker_id, "device": w.model.device, "simulated": w.model.simulated, **w.stats}
                for w in workers
            ],
            "gpu": _combined(workers),
            "models": _per_model(workers),
            "cells": cells_document(readings),
        }
    )
    return jsonify(summary.to_json())


def _per_model(workers: list[Heartbeat]) -> dict:
    """Per name:version, the recent window of the worker that answered most of its jobs."""
    best: dict[str, dict] = {}
    for worker in workers:
        for model in worker.served_models():
            stats = {**model.stats, "worker_id": worker.worker_id}
            if model.key not in best or stats.get("jobs", 0) > best[model.key].get("jobs", 0):
                best[model.key] = stats
    return best


def _combined(workers: list[Heartbeat]) -> dict:
    """Across workers: mean busy fraction, totals, and the busiest worker's time bill."""
    if not workers:
        return {"workers": 0}
    stats = [w.stats for w in workers]
    busiest = max(stats, key=lambda s: s.get("batches", 0))
    sizes = [(s.get("batch_size_mean") or 0) * s.get("batches", 0) for s in stats]
    batches = sum(s.get("batches", 0) for s in stats)
    return {
        "workers": len(workers),
        "simulated": any(w.model.simulated for w in workers),
        "busy": round(sum(s.get("busy", 0.0) for s in stats) / len(stats), 4),
        "device_seconds_total": round(sum(s.get("device_seconds_total", 0.0) for s in stats), 4),
        "frames_total": sum(s.get("frames_total", 0) for s in stats),
        "batches_total": sum(s.get("batches_total", 0) for s in stats),
        "batch_size_mean": round(sum(sizes) / batches, 3) if batches else None,
        "time_bill_ms": busiest.get("time_bill_ms", {}),
    }
