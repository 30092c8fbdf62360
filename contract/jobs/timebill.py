"""The time bill: how long each stage of one request took.

Each process stamps wall-clock times (epoch seconds) or durations as the job
passes (the stamps' names are here, beside the stages they bound); `compute_time_bill`
turns the stamps into milliseconds per stage, and
`summarise_bills` many bills into percentiles per stage (the GPU worker's
heartbeat and the bench's reports give the same figures).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

# Each stage of a request's life, in order, with what its milliseconds cover.
STAGE_DESCRIPTIONS = {
    "receive": "API: request start -> upload stored and task sent",
    "queue_cpu": "waiting for a CPU worker",
    "decode": "CPU worker: image decode (draft mode, EXIF, colour mode)",
    "resize": "CPU worker: letterbox resize",
    "backpressure": "CPU worker: the frame waiting for room in the bounded frame list (0 unless it was full)",
    "queue_gpu": "frame packed and pushed -> popped from the Redis list",
    "batch_wait": "popped -> its batch closed (the batching window, or less when the batch filled)",
    "device_queue": "batch closed -> its turn on the device (waiting for the batches ahead of it)",
    "infer": "batch assembly on the device and the forward pass",
    "postprocess": "decode, NMS, letterbox inversion",
    "total": "request start -> result written (or the job's end: failed, expired, cancelled)",
}
STAGES = tuple(STAGE_DESCRIPTIONS)

# The stamps, by the process that writes each, in the order a job meets them: a moment (epoch seconds, `_at`) or
# a duration (milliseconds, `_ms`). The job record keeps the API's and the CPU worker's (RECORD_STAMPS); the
# frame's header carries them on to the GPU worker (FrameHeader.stamps), which adds its own and bills the job.
RECEIVED_AT: Final = "received_at"  # API: the request began
SUBMITTED_AT: Final = "submitted_at"  # API: the upload stored, the task queued
CPU_STARTED_AT: Final = "cpu_started_at"  # CPU worker: the job claimed
DECODE_MS: Final = "decode_ms"  # CPU worker
RESIZE_MS: Final = "resize_ms"  # CPU worker
BACKPRESSURE_MS: Final = "backpressure_ms"  # CPU worker: the frame waiting for room on its list
PUSHED_AT: Final = "pushed_at"  # CPU worker: the frame pushed
POPPED_AT: Final = "popped_at"  # GPU worker: the frame taken from the list
BATCH_CLOSED_AT: Final = "batch_closed_at"  # GPU worker
DEVICE_STARTED_AT: Final = "device_started_at"  # GPU worker: the batch's turn on the device
INFER_MS: Final = "infer_ms"  # GPU worker
POSTPROCESS_MS: Final = "postprocess_ms"  # GPU worker
FINISHED_AT: Final = "finished_at"  # whoever ends the job
RECORD_STAMPS = (RECEIVED_AT, SUBMITTED_AT, CPU_STARTED_AT, DECODE_MS, RESIZE_MS, BACKPRESSURE_MS, PUSHED_AT)
# What the push writes of them to the record: the ones it is first to know. The API's two are the record's from its
# intake and the claim wrote `cpu_started_at` (the same moment), so sending them again changed nothing. The three
# durations stay: a job that ends after its push without the GPU worker's bill (the sweep's expiry while it waits
# in `queued_gpu`, a frame that fails) shows decode, resize and backpressure in its time bill, computed from the
# record (contract.documents). `pushed_at` bills no stage from the record (its end, `popped_at`, is never there)
# and is kept as the moment the frame went in.
PUSH_STAMPS = (DECODE_MS, RESIZE_MS, BACKPRESSURE_MS, PUSHED_AT)

_SPANS = {
    "receive": (RECEIVED_AT, SUBMITTED_AT),
    "queue_cpu": (SUBMITTED_AT, CPU_STARTED_AT),
    "queue_gpu": (PUSHED_AT, POPPED_AT),
    "batch_wait": (POPPED_AT, BATCH_CLOSED_AT),
    "device_queue": (BATCH_CLOSED_AT, DEVICE_STARTED_AT),
    "total": (RECEIVED_AT, FINISHED_AT),
}
_DURATIONS = {
    "decode": DECODE_MS,
    "resize": RESIZE_MS,
    "backpressure": BACKPRESSURE_MS,
    "infer": INFER_MS,
    "postprocess": POSTPROCESS_MS,
}


# Per stage in order: (stage, the stamp holding its duration) or (stage, start stamp, end stamp).
_RULES = tuple((stage, _DURATIONS[stage]) if stage in _DURATIONS else (stage, *_SPANS[stage]) for stage in STAGES)


def compute_time_bill(stamps: Mapping[str, float]) -> dict[str, float]:
    """Milliseconds per stage; a stage whose stamps are missing is left out."""
    bill: dict[str, float] = {}
    get = stamps.get
    for rule in _RULES:
        if len(rule) == 2:
            value = get(rule[1])
            if value is not None:
                bill[rule[0]] = round(float(value), 3)
        else:
            start, end = get(rule[1]), get(rule[2])
            if start is not None and end is not None:
                bill[rule[0]] = round(max(0.0, (end - start) * 1000.0), 3)
    return bill


# The GPU worker's host time per batch, by stage, in the order a batch meets them (the stages
# themselves are gpu_worker/feeder.py, devices.py and finish.py). `forward` is the device's turn,
# its wait included (on `sim`, the simulated latency). The worker keeps running totals in its
# counters hash as host_wall_s:<stage> and host_cpu_s:<stage> (its stage thread's CPU time).
HOST_STAGES = ("pop", "unpack", "triage", "stage", "forward", "readback", "documents", "write")


def host_counter_fields(wall_s: Mapping[str, float], cpu_s: Mapping[str, float]) -> dict[str, float]:
    fields = {f"host_wall_s:{stage}": round(value, 6) for stage, value in wall_s.items()}
    fields.update({f"host_cpu_s:{stage}": round(value, 6) for stage, value in cpu_s.items()})
    return fields


def host_ms_per_batch(counters: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """From a worker's counters: per stage, the mean wall and CPU milliseconds per batch."""
    batches = counters.get("batches_total") or 0.0
    table: dict[str, dict[str, float]] = {}
    for stage in HOST_STAGES:
        wall = counters.get(f"host_wall_s:{stage}")
        if wall is not None and batches:
            cpu = counters.get(f"host_cpu_s:{stage}") or 0.0
            table[stage] = {"wall": round(wall / batches * 1000.0, 3), "cpu": round(cpu / batches * 1000.0, 3)}
    return table


def summarise_bills(bills: list[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per stage p50 / p95 / mean in ms, and its share of the mean total."""
    summary: dict[str, dict[str, float]] = {}
    totals = [b["total"] for b in bills if "total" in b]
    mean_total = sum(totals) / len(totals) if totals else 0.0
    for stage in STAGES:
        values = sorted(b[stage] for b in bills if stage in b)
        if not values:
            continue
        summary[stage] = stage_figures(values, mean_total, stage)
    return summary


def stage_figures(values: list[float], mean_total: float, stage: str) -> dict[str, float]:
    """One stage's p50 / p95 / mean and its share of the mean total, from its sorted values (summarise_bills,
    and the GPU worker's window of the same figures in arrays: gpu_worker.stats.summarise_columns)."""
    mean = sum(values) / len(values)
    return {
        "p50": round(percentile(values, 50), 3),
        "p95": round(percentile(values, 95), 3),
        "mean": round(mean, 3),
        "share": round(mean / mean_total, 4) if mean_total and stage != "total" else 1.0,
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    position = (len(sorted_values) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)
