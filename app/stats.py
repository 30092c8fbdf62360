"""`GET /v1/stats`: a JSON summary of queues, GPU workers, the time bill and the result cache."""

from __future__ import annotations

from typing import cast

from flask import Blueprint, Response, jsonify

from app.auth import require_admin
from app.health import live_gpu_workers
from app.operations import Reply, operation
from app.services import services as current_services
from contract.clock import now as service_now
from contract.heartbeat import Heartbeat
from contract.jobs.backlog import total_depths
from contract.keys import model_frames_total
from contract.scaling import backlogs, scaling_signal, windows_of
from contract.status_documents import Stats
from contract.timebill import host_ms_per_batch

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
    client, keys = services.redis, services.keys
    workers = live_gpu_workers()
    for worker in workers:  # live totals, fresher than the heartbeat's
        raw = cast(dict[bytes, bytes], client.hgetall(keys.gpu_counters(worker.worker_id)))
        # The worker's totals; its per-model frames (contract.keys.model_frames_total) are for admission's drain rate.
        counters = {k.decode(): float(v) for k, v in raw.items() if not k.decode().startswith(model_frames_total(""))}
        worker.stats.update(counters, host_ms_per_batch=host_ms_per_batch(counters))
    model_keys = list(services.catalogue.specs)
    found = backlogs(client, keys, model_keys, services.settings.tenants)
    depths = {key: {"preprocess": backlog.queued, "frames": backlog.frames} for key, backlog in found.items()}
    windows = windows_of(workers, service_now())
    summary = Stats.model_validate(
        {
            "scaling": {
                key: scaling_signal(found[key], windows.get(key, []), services.settings.scaling).to_json()
                for key in model_keys
            },
            "cache": services.cache.stats(list(services.catalogue.specs)),
            "queues": total_depths(depths),
            "queues_by_model": depths,
            "gpu_workers": [
                {"worker_id": w.worker_id, "device": w.model.device, "simulated": w.model.simulated, **w.stats}
                for w in workers
            ],
            "gpu": _combined(workers),
            "models": _per_model(workers),
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
