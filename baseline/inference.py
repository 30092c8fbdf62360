"""One batch, serially: stage, run, result documents.

The serial baseline answers each request this way, through the same device
code (canvas, model, post-processing, or the simulated device) as the GPU
worker's overlapped stages, so the two compare like for like.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contract.frames import Frame
from gpu_worker.finish import result_documents
from gpu_worker.staging import Device
from gpu_worker.stats import BusyMeter


@dataclass(frozen=True)
class BatchRun:
    documents: list[dict[str, Any]]  # one result document per frame, in order
    infer_ms: float  # canvas + forward
    postprocess_ms: float  # post-processing + the documents
    device_s: float  # device busy time
    errors: dict[int, dict[str, str]] = field(default_factory=dict)  # frame index -> error, failed alone


class BatchRunner:
    def __init__(self, device: Device, busy: BusyMeter | None = None) -> None:
        self.device = device
        self.busy = busy or BusyMeter()

    def run(self, frames: Sequence[Frame]) -> BatchRun:
        output = self.device.run(self.device.stage(frames))
        ended = time.monotonic()
        self.busy.record(ended - output.device_s, ended)
        started = time.perf_counter()
        documents = result_documents(output.detections, frames, self.device.spec)
        documents_ms = (time.perf_counter() - started) * 1000.0
        return BatchRun(
            documents, output.infer_ms, output.postprocess_ms + documents_ms, output.device_s, output.errors
        )
