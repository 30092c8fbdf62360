"""One batch through the model: assemble on the device, forward, vectorised
post-processing, result documents. Shared by the GPU worker and the serial
baseline, so both run exactly the same model code."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from contract.frames import Frame
from contract.settings import ModelSpec
from gpu_worker.model import BatchAssembler, LoadedModel
from gpu_worker.postprocess import Detections, Geometry, Thresholds, postprocess
from gpu_worker.stats import BusyMeter


@dataclass(frozen=True)
class BatchRun:
    documents: list[dict[str, Any]]   # one result document per frame, in order
    infer_ms: float                   # assembly + forward
    postprocess_ms: float
    device_s: float                   # the forward alone: device busy time


@dataclass
class PreparedInputs:
    """A batch's input, assembled on the device (on CUDA, by a side stream) ahead of its turn."""
    tensor: torch.Tensor
    assemble_ms: float
    ready: Any = None                 # a CUDA event the compute stream waits on


class BatchRunner:
    """prepare() can run in another thread while the previous batch's execute() holds the device."""

    def __init__(self, model: LoadedModel, max_candidates: int, busy: BusyMeter | None = None) -> None:
        self.model = model
        self.max_candidates = max_candidates
        self.busy = busy or BusyMeter()
        self.assemble = BatchAssembler(model.spec, model.device)
        self.copy_stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None

    def prepare(self, frames: Sequence[Frame]) -> PreparedInputs:
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self.copy_stream is None:
                return PreparedInputs(self.assemble(frames), (time.perf_counter() - t0) * 1000.0)
            with torch.cuda.stream(self.copy_stream):
                tensor = self.assemble(frames)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            ready.synchronize()   # the pinned staging buffer is free again once its copy is done
        return PreparedInputs(tensor, (time.perf_counter() - t0) * 1000.0, ready)

    def execute(self, frames: Sequence[Frame], prepared: PreparedInputs,
                on_device_done: Callable[[], None] = lambda: None) -> BatchRun:
        """The forward, then `on_device_done()` (the device is free for the next batch), then
        post-processing."""
        spec, device = self.model.spec, self.model.device
        with torch.inference_mode():
            inputs = prepared.tensor
            if prepared.ready is not None:
                torch.cuda.current_stream(device).wait_event(prepared.ready)
                inputs.record_stream(torch.cuda.current_stream(device))
            device_started = time.monotonic()
            output = self.model.module(inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            device_ended = time.monotonic()
            on_device_done()
            self.busy.record(device_started, device_ended)
            t1 = time.perf_counter()
            detections = postprocess(output, spec.layout, thresholds(frames, spec, device),
                                     geometry(frames, device), self.max_candidates)
            documents = result_documents(detections, frames, self.model)
        t2 = time.perf_counter()
        infer_ms = prepared.assemble_ms + (device_ended - device_started) * 1000.0
        return BatchRun(documents, infer_ms, (t2 - t1) * 1000.0, device_ended - device_started)

    def run(self, frames: Sequence[Frame]) -> BatchRun:
        return self.execute(frames, self.prepare(frames))


def thresholds(frames: Sequence[Frame], spec: ModelSpec, device: torch.device) -> Thresholds:
    options = [frame.header.options for frame in frames]
    return Thresholds(
        conf=torch.tensor([o.get("conf", spec.conf) for o in options], dtype=torch.float32, device=device),
        iou=torch.tensor([o.get("iou", spec.iou) for o in options], dtype=torch.float32, device=device),
        max_det=torch.tensor([o.get("max_det", spec.max_det) for o in options], device=device),
    )


def geometry(frames: Sequence[Frame], device: torch.device) -> Geometry:
    columns = ("pad_left", "pad_top", "scale_x", "scale_y", "orig_width", "orig_height")
    values = torch.tensor([[float(getattr(f.header, c)) for c in columns] for f in frames],
                          dtype=torch.float64).to(device)
    return Geometry(*(values[:, i] for i in range(len(columns))))


def result_documents(detections: Detections, frames: Sequence[Frame], model: LoadedModel) -> list[dict[str, Any]]:
    """One result document per frame, built from CPU copies of the batch's detections."""
    labels = model.spec.labels
    image_index = detections.image_index.tolist()
    boxes = detections.boxes.double().round(decimals=2).tolist()
    scores = detections.scores.tolist()
    class_ids = detections.class_ids.tolist()
    per_image: list[list[dict[str, Any]]] = [[] for _ in frames]
    for image, box, score, class_id in zip(image_index, boxes, scores, class_ids):
        per_image[image].append({"box": box, "score": round(score, 4), "class_id": class_id,
                                 "label": labels[class_id] if class_id < len(labels) else str(class_id)})
    model_info = {"name": model.spec.name, "version": model.spec.version}
    return [{"detections": dets, "image": {"width": f.header.orig_width, "height": f.header.orig_height},
             "model": model_info} for dets, f in zip(per_image, frames)]
