"""`bench nms`: post-processing's cost per batch in its worst cases, on the worker's own code.

A head with random weights at `conf=0` puts every candidate above the threshold:
NMS then sees `max_candidates` boxes per image. Two shapes of the worst case:
boxes spread over the image (few suppress each other: NMS keeps many) and boxes
piled on one object (long suppression chains), each with one class and with 80.
"""

from __future__ import annotations

import time

import torch

from gpu_worker.postprocess import Geometry, Thresholds, postprocess

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
