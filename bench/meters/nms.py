"""`bench nms`: post-processing's cost per batch in its worst cases, on the worker's own code.

A head with random weights at `conf=0` puts every candidate above the threshold:
NMS then sees `max_candidates` boxes per image. Two shapes of the worst case:
boxes spread over the image (few suppress each other: NMS keeps many) and boxes
piled on one object (long suppression chains), each with one class and with 80.
"""

from __future__ import annotations

import time

import torch

from bench.stack.processes import REPO_ROOT
from gpu_worker.postprocess import Geometry, Thresholds, postprocess, postprocess_rows

ANCHORS = 8400  # a 640 YOLOv8 head


def head_output(batch: int, classes: int, spread: bool, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    output = torch.rand(batch, 4 + classes, ANCHORS, generator=generator)
    if spread:
        output[:, 0:2] *= 640
        output[:, 2:4] *= 200
    else:
        output[:, 0:2] = 300 + torch.randn(batch, 2, ANCHORS, generator=generator) * 20
        output[:, 2:4] = 100 + torch.randn(batch, 2, ANCHORS, generator=generator) * 10
    return output


def measure(batch: int, max_candidates: int, max_det: int, repeats: int = 5) -> list[dict]:
    thresholds = Thresholds(
        conf=torch.zeros(batch), iou=torch.full((batch,), 0.45), max_det=torch.full((batch,), max_det, dtype=torch.long)
    )
    geometry = Geometry(
        torch.zeros(batch),
        torch.zeros(batch),
        torch.ones(batch),
        torch.ones(batch),
        torch.full((batch,), 640.0),
        torch.full((batch,), 640.0),
    )
    rows = []
    for spread in (True, False):
        for classes in (1, 80):
            output = head_output(batch, classes, spread)
            postprocess(output, "yolov8", thresholds, geometry, max_candidates)  # warm
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                found = postprocess(output, "yolov8", thresholds, geometry, max_candidates)
                times.append((time.perf_counter() - started) * 1000.0)
            rows.append(
                {
                    "boxes": "spread" if spread else "piled",
                    "classes": classes,
                    "median_ms": sorted(times)[len(times) // 2],
                    "max_ms": max(times),
                    "kept_per_image": len(found.scores) / batch,
                }
            )
    return rows


def describe(batch: int, max_candidates: int, max_det: int) -> str:
    lines = [
        f"post-processing of a batch of {batch} at conf=0 ({ANCHORS} anchors, max_candidates={max_candidates}, "
        f"max_det={max_det}, iou=0.45, CPU, {torch.get_num_threads()} threads)",
        "",
        "| boxes | classes | median ms | max ms | kept per image |",
        "|---|---|---|---|---|",
    ]
    for row in measure(batch, max_candidates, max_det):
        lines.append(
            f"| {row['boxes']} | {row['classes']} | {row['median_ms']:.1f} | {row['max_ms']:.1f} | "
            f"{row['kept_per_image']:.0f} |"
        )
    return "\n".join(lines)


# --- one frame's options in a batch of others ----------------------------------------------------------------

EXPENSIVE = (0.0, 1.0, 1000)  # conf, iou, max_det: every candidate, none suppressed, as many as may be asked


def shapes_outputs(batch: int, device: str = "cpu") -> tuple[torch.Tensor, Geometry, tuple[float, float, int]]:
    """The default model's (shapes-yolo) head output for `batch` letterboxed frames of the samples, on `device`,
    their geometry, and the model's default options."""
    from PIL import Image

    from contract.settings.config import load_settings
    from contract.settings.models import default_model
    from gpu_worker.model import load_model
    from tasks.decoding.imaging import letterbox

    spec = default_model(load_settings())
    model = load_model(spec, torch.device(device), max_batch=batch)
    samples = sorted((REPO_ROOT / "samples").glob("*.jpg"))
    size, canvases, places = spec.input_size, [], []
    for i in range(batch):
        image = Image.open(samples[i % len(samples)]).convert("RGB")
        boxed = letterbox(image, image.size, size)
        at = boxed.placement
        content = torch.frombuffer(bytearray(boxed.pixels), dtype=torch.uint8).reshape(at.height, at.width, 3)
        canvas = torch.full((3, size, size), spec.pad_value, dtype=torch.uint8)
        canvas[:, at.pad_top : at.pad_top + at.height, at.pad_left : at.pad_left + at.width] = content.permute(2, 0, 1)
        canvases.append(canvas)
        places.append([at.pad_left, at.pad_top, at.scale_x, at.scale_y, at.orig_width, at.orig_height])
    with torch.no_grad():
        output = model.module(torch.stack(canvases).to(device, model.dtype) * spec.scale)
    geometry = Geometry(*torch.tensor(places, dtype=torch.float64, device=device).T)
    return output, geometry, (spec.conf, spec.iou, spec.max_det)


def thresholds_for(options: list[tuple[float, float, int]], device: str | torch.device = "cpu") -> Thresholds:
    conf, iou, max_det = zip(*options)
    return Thresholds(
        torch.tensor(conf, device=device), torch.tensor(iou, device=device), torch.tensor(max_det, device=device)
    )


def measure_neighbours(batch: int = 8, repeats: int = 21, device: str = "cpu") -> dict[str, float]:
    """Median ms of the batch's post-processing (postprocess_rows, as the GPU worker runs it: its answer on the
    host, so the device's work is in it): every frame with the model's defaults, and the same batch with its last
    frame at EXPENSIVE. On the CPU, CPU time on one thread (a figure other processes on the machine move less);
    on CUDA, wall time."""
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        torch.set_num_threads(1)
    clock = time.process_time if on_cpu else time.perf_counter
    output, geometry, normal = shapes_outputs(batch, device)
    cases = {"normal": [normal] * batch, "one_expensive": [normal] * (batch - 1) + [EXPENSIVE]}
    medians = {}
    for name, options in cases.items():
        limits = thresholds_for(options, output.device)
        postprocess_rows(output, "yolov8", limits, geometry)  # warm
        times = []
        for _ in range(repeats):
            started = clock()
            postprocess_rows(output, "yolov8", limits, geometry)
            times.append((clock() - started) * 1000.0)
        medians[name] = sorted(times)[len(times) // 2]
    return medians


def describe_neighbours(batch: int, device: str = "cpu") -> str:
    medians = measure_neighbours(batch, device=device)
    what = "CPU ms on one thread" if torch.device(device).type == "cpu" else f"wall ms on {device}"
    return "\n".join(
        [
            f"post-processing of a batch of {batch} shapes-yolo frames (the samples), median {what}",
            "",
            "| batch | ms |",
            "|---|---|",
            f"| {batch} frames at the model's defaults | {medians['normal']:.2f} |",
            f"| {batch - 1} at the defaults + 1 at conf=0, iou=1, max_det=1000 | {medians['one_expensive']:.2f} |",
        ]
    )
