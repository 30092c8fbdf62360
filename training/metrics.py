"""mAP@0.5, VOC style (all-point interpolation), on plain Python lists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Box = Sequence[float]


@dataclass(frozen=True)
class ImageTruth:
    boxes: Sequence[Box]
    classes: Sequence[int]


@dataclass(frozen=True)
class ImagePredictions:
    boxes: Sequence[Box]
    scores: Sequence[float]
    classes: Sequence[int]


def box_iou(a: Box, b: Box) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def average_precision(
    truths: Sequence[ImageTruth], predictions: Sequence[ImagePredictions], class_id: int, iou_threshold: float = 0.5
) -> float | None:
    """AP of one class; None when the class has no ground truth."""
    gt = {i: [b for b, c in zip(t.boxes, t.classes) if c == class_id] for i, t in enumerate(truths)}
    total = sum(len(v) for v in gt.values())
    if total == 0:
        return None
    taken = {i: [False] * len(v) for i, v in gt.items()}
    ranked = sorted(
        (
            (s, i, b)
            for i, p in enumerate(predictions)
            for b, s, c in zip(p.boxes, p.scores, p.classes)
            if c == class_id
        ),
        key=lambda r: -r[0],
    )
    hits = np.zeros(len(ranked))
    for k, (_, image, box) in enumerate(ranked):
        overlaps = [box_iou(box, g) for g in gt[image]]
        best = int(np.argmax(overlaps)) if overlaps else -1
        if best >= 0 and overlaps[best] >= iou_threshold and not taken[image][best]:
            taken[image][best] = True
            hits[k] = 1
    if not len(ranked):
        return 0.0
    tp = np.cumsum(hits)
    recall = tp / total
    precision = tp / np.arange(1, len(ranked) + 1)
    recall = np.concatenate([[0.0], recall, [1.0]])
    precision = np.concatenate([[1.0], precision, [0.0]])
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    steps = np.nonzero(recall[1:] != recall[:-1])[0]
    return float(np.sum((recall[steps + 1] - recall[steps]) * precision[steps + 1]))


def mean_average_precision(
    truths: Sequence[ImageTruth], predictions: Sequence[ImagePredictions], num_classes: int, iou_threshold: float = 0.5
) -> tuple[float, dict[int, float]]:
    per_class = {c: average_precision(truths, predictions, c, iou_threshold) for c in range(num_classes)}
    scored = {c: ap for c, ap in per_class.items() if ap is not None}
    return (sum(scored.values()) / len(scored) if scored else 0.0), scored
