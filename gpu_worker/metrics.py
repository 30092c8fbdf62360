"""Prometheus metrics of the GPU worker, served on its own port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

# Every per-batch and per-job metric carries the model's name and version (labels `model`, `version`);
# the busy ratio is the device's, whatever it ran.
MODEL_LABELS = ("model", "version")
BATCH_SIZE = Histogram(
    "imgserve_gpu_batch_size", "Frames per batch popped", MODEL_LABELS, buckets=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32)
)
BATCH_WAIT = Histogram(
    "imgserve_gpu_batch_wait_seconds",
    "First pop to batch close",
    MODEL_LABELS,
    buckets=(0.001, 0.002, 0.005, 0.01, 0.012, 0.015, 0.02, 0.05, 0.1),
)
DEVICE_SECONDS = Counter("imgserve_gpu_device_seconds_total", "Seconds the device spent running batches", MODEL_LABELS)
FRAMES = Counter("imgserve_gpu_frames_total", "Frames taken from the list", MODEL_LABELS)
FRAMES_INFERRED = Counter("imgserve_gpu_frames_inferred_total", "Frames that reached the model", MODEL_LABELS)
GPU_BUSY = Gauge("imgserve_gpu_busy_ratio", "Fraction of wall time the device was busy (sliding window)")
QUEUE_DEPTH = Gauge(
    "imgserve_queue_depth", "Jobs waiting: a model's preprocess queue and its GPU frame list", ["queue", *MODEL_LABELS]
)
# The backlog as the product sees it and what it wants (contract.workers.scaling), deployment-wide: every GPU worker
# exports the same figures (an autoscaler reads max() of them), per model.
BACKLOG = Gauge(
    "imgserve_backlog",
    "Jobs accepted and not yet taken by a GPU worker: queued for a CPU worker, held by one, or frames",
    ["where", *MODEL_LABELS],
)
CPU_WORKERS_WANTED = Gauge(
    "imgserve_cpu_workers_wanted",
    "CPU worker processes the model's backlog and rate want at scaling.target_utilisation (contract.workers.scaling)",
    MODEL_LABELS,
)
# The result cache's size, deployment-wide, as Redis holds it (read with the heartbeat); hits and misses are the
# API's counter (imgserve_api_cache_lookups_total).
CACHE_ENTRIES = Gauge("imgserve_cache_entries", "Result-cache entries held")
CACHE_BYTES = Gauge("imgserve_cache_bytes", "Bytes charged to the result cache's entries (within cache.max_bytes)")
CACHE_MAX_BYTES = Gauge("imgserve_cache_max_bytes", "The result cache's budget (cache.max_bytes)")
STAGE_SECONDS = Histogram(
    "imgserve_stage_seconds",
    "Time-bill stages of answered jobs",
    ["stage", *MODEL_LABELS],
    buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2, 5, 10),
)
FRAMES_EXPIRED = Counter(
    "imgserve_gpu_frames_expired_total", "Frames dropped because their deadline passed", MODEL_LABELS
)


def observe_batch(model: tuple[str, str], popped: int, inferred: int, wait_s: float) -> None:
    BATCH_SIZE.labels(*model).observe(popped)
    BATCH_WAIT.labels(*model).observe(wait_s)
    FRAMES.labels(*model).inc(popped)
    FRAMES_INFERRED.labels(*model).inc(inferred)


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Prometheus's page on this port (0: none), bound to `host`: this machine only unless told otherwise (the
    compose file binds 0.0.0.0 on its internal network for Prometheus)."""
    if port:
        start_http_server(port, host)


_STAGE_CHILDREN: dict[tuple[str, str, str], Histogram] = {}


def observe_bill(model: tuple[str, str], bill: dict) -> None:
    for stage, ms in bill.items():
        child = _STAGE_CHILDREN.get((stage, *model))
        if child is None:
            child = _STAGE_CHILDREN[(stage, *model)] = STAGE_SECONDS.labels(stage, *model)
        child.observe(ms / 1000.0)
