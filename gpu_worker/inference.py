"""One batch through the model: assemble on the device, forward, vectorised
post-processing, result documents. Shared by the GPU worker and the serial
baseline, so both run exactly the same model code."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

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


class BatchRunner:
    def __init__(self, model: LoadedModel, max_candidates: int, busy: BusyMeter | None = None) -> None:
        self.model = model
        self.max_candidates = max_candidates
        self.busy = busy or BusyMeter()
        self.assemble = BatchAssembler(model.spec, model.device)

    def run(self, frames: Sequence[Frame]) -> BatchRun:
        spec, device = self.model.spec, self.model.device
        t0 = time.perf_counter()
        with torch.inference_mode():
            inputs = self.assemble(frames)
            device_started = time.monotonic()
            output = self.model.module(inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            device_ended = time.monotonic()
            self.busy.record(device_started, device_ended)
            t1 = time.perf_counter()
            detections = postprocess(output, spec.layout, thresholds(frames, spec, device),
                                     geometry(frames, device), self.max_candidates)
            documents = result_documents(detections, frames, self.model)
        t2 = time.perf_counter()
        return BatchRun(documents, (t1 - t0) * 1000.0, (t2 - t1) * 1000.0, device_ended - device_started)


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
