"""What a GPU worker says of itself in its heartbeat (contract.workers.heartbeat): its device and models, its batching,
and its recent figures, per model and in all."""

from __future__ import annotations

import os
import socket
from typing import Any

from contract.workers.heartbeat import Batching, Heartbeat, HeartbeatModel
from gpu_worker.lanes import Lane
from gpu_worker.staging import Device
from gpu_worker.stats import BusyMeter, RecentStats


def model_stats(lane: Lane) -> dict[str, Any]:
    """One model's recent window on this worker: jobs, p95, batch sizes, the time bill."""
    summary = lane.recent.summary()
    return {
        **lane.recent.latency(),
        "batches": summary["batches"],
        "batch_size_mean": summary["batch_size_mean"],
        "time_bill_ms": summary["time_bill_ms"],
        "window_s": summary["window_s"],  # what `jobs` is counted over (contract.workers.scaling: the rate)
    }


def describe_worker(
    worker_id: str, started_at: float, device: Device, lanes: list[Lane], busy: BusyMeter, recent: RecentStats
) -> Heartbeat:
    """`device`: the one the lanes share (its name, utilisation and first model)."""
    collector = lanes[0].feeder.collector
    return Heartbeat(
        worker_id=worker_id,
        pid=os.getpid(),
        host=socket.gethostname(),
        started_at=started_at,
        model=HeartbeatModel(**device.describe()),
        models=[HeartbeatModel(**lane.device.describe(), stats=model_stats(lane)) for lane in lanes],
        batching=Batching(max_batch_size=collector.max_size, window_ms=collector.window_s * 1000.0),
        stats={
            "busy": round(busy.fraction(), 4),
            "busy_window_s": busy.window_s,
            "nvml_utilisation": device.utilisation(),
            "device_seconds_total": round(busy.total_s, 4),
            "batches_total": recent.batches_total,
            "frames_total": recent.frames_total,
            **recent.summary(),
        },
    )
