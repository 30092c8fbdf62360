"""Batched, vectorised post-processing: confidence filter, box decode,
class-aware NMS, max_det, and the letterbox undone into original pixels.

No per-box Python loop on the hot path: every step is a tensor op over the
whole batch. Per-image `conf`, `iou` and `max_det` are tensors, so each job
keeps its own options inside one batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# How many candidates (in score order) are settled together: each chunk is resolved exactly, then
# suppresses every later candidate in one matrix op. Memory is O(B * NMS_CHUNK * K), not O(B * K^2).
NMS_CHUNK = 64


@dataclass(frozen=True)
class Geometry:
    """Per image, how the letterbox placed the original: [B] tensors."""
    pad_left: torch.Tensor
    pad_top: torch.Tensor
    scale_x: torch.Tensor
    scale_y: torch.Tensor
    orig_width: torch.Tensor
    orig_height: torch.Tensor


@dataclass(frozen=True)
class Thresholds:
    conf: torch.Tensor      # [B] float
    iou: torch.Tensor       # [B] float
    max_det: torch.Tensor   # [B] int


@dataclass(frozen=True)
class Detections:
    """Flat over the batch: row i belongs to image `image_index[i]`."""
    image_index: torch.Tensor   # [K] long
    boxes: torch.Tensor         # [K, 4] x1, y1, x2, y2 in original pixels
    scores: torch.Tensor        # [K]
    class_ids: torch.Tensor     # [K] long


def split_layout(output: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Model output -> (cxcywh [B, N, 4], class scores [B, N, C])."""
    if output.dim() != 3:
        raise ValueError(f"detector output must be 3-D, got shape {tuple(output.shape)}")
    if layout == "yolov8":                       # [B, 4 + C, N]
        rows = output.transpose(1, 2)
        return rows[..., :4], rows[..., 4:]
    if layout == "yolov5":                       # [B, N, 5 + C], objectness at 4
        return output[..., :4], output[..., 5:] * output[..., 4:5]
    raise ValueError(f"unknown layout {layout!r}")


def cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    centre, size = boxes[..., :2], boxes[..., 2:4] / 2
    return torch.cat([centre - size, centre + size], dim=-1)


def postprocess(output: torch.Tensor, layout: str, thresholds: Thresholds, geometry: Geometry,
                max_candidates: int = 1000) -> Detections:
    cxcywh, class_scores = split_layout(output.float(), layout)
    scores, class_ids = class_scores.max(dim=-1)                       # [B, N]
    below = scores < thresholds.conf[:, None]
    scores = scores.masked_fill(below, -1.0)
    # NMS costs k^2: take no more candidates than the fullest image has above its threshold.
    k = min(max_candidates, int((~below).sum(dim=1).max()) if len(scores) else 0)
    top_scores, top_index = scores.topk(k, dim=1)                      # sorted, best first
    valid = top_scores >= 0
    boxes = cxcywh_to_xyxy(torch.gather(cxcywh, 1, top_index[..., None].expand(-1, -1, 4)))
    classes = torch.gather(class_ids, 1, top_index)
    keep = nms_keep(boxes, classes, valid, thresholds.iou, thresholds.max_det)
    keep &= keep.cumsum(dim=1) <= thresholds.max_det[:, None]
    image_index, slot = keep.nonzero(as_tuple=True)
    return Detections(
        image_index=image_index,
        boxes=unletterbox(boxes[image_index, slot], geometry, image_index),
        scores=top_scores[image_index, slot],
        class_ids=classes[image_index, slot],
    )


def unletterbox(boxes: torch.Tensor, geometry: Geometry, image_index: torch.Tensor) -> torch.Tensor:
    """Input-pixel boxes [K, 4] -> original-image pixels, clipped to the image."""
    g = {name: getattr(geometry, name).to(boxes.device, torch.float32)[image_index]
         for name in ("pad_left", "pad_top", "scale_x", "scale_y", "orig_width", "orig_height")}
    x = (boxes[:, [0, 2]] - g["pad_left"][:, None]) / g["scale_x"][:, None]
    y = (boxes[:, [1, 3]] - g["pad_top"][:, None]) / g["scale_y"][:, None]
    x = torch.minimum(x.clamp(min=0), g["orig_width"][:, None])
    y = torch.minimum(y.clamp(min=0), g["orig_height"][:, None])
    return torch.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], dim=1)


def nms_keep(boxes: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor, iou: torch.Tensor,
             max_det: torch.Tensor | None = None, chunk: int = NMS_CHUNK) -> torch.Tensor:
    """Class-aware greedy NMS per image: a [B, K] keep mask. Inputs [B, K, ...] sorted by score, best first.

    Exactly greedy NMS, in chunks of `chunk` candidates taken in score order: a
    chunk's own boxes are settled by a fixed point over their small IoU matrix
    (Cluster-NMS: as many rounds as the longest suppression chain inside the
    chunk, at most `chunk`), then the chunk's kept boxes suppress every later
    candidate at once. Once every image holds `max_det` kept boxes, later
    candidates can no longer reach the answer and the scan stops: at `conf=0`
    with 1,000 candidates and `max_det` 100 it settles a few chunks, not all.
    """
    batch, k = valid.shape
    keep = torch.zeros_like(valid)
    removed = ~valid
    for start in range(0, k, chunk):
        end = min(start + chunk, k)
        alive = ~removed[:, start:end]
        if not bool(alive.any()):           # every candidate here is already suppressed (or invalid)
            continue
        inter, union = _overlap(boxes[:, start:end], boxes[:, start:])
        # IoU > t  <=>  inter > t * union: no division over the [B, chunk, K] block
        overlaps = (inter > union.mul_(iou[:, None, None])) \
            & (classes[:, start:end, None] == classes[:, None, start:])              # [B, chunk, K - start]
        kept = _settle_chunk(overlaps[:, :, :end - start], alive)
        keep[:, start:end] = kept
        if end == k:
            break
        removed[:, end:] |= (overlaps[:, :, end - start:] & kept[:, :, None]).any(dim=1)
        if max_det is not None and bool((keep.sum(dim=1) >= max_det).all()):
            break
    return keep


def _settle_chunk(overlaps: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """Greedy NMS among one chunk's candidates ([B, n, n] overlaps, [B, n] alive): kept[i] = alive[i]
    and no kept j < i overlaps i. Iterating from kept = alive settles on exactly the greedy answer."""
    n = alive.shape[1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=alive.device).triu(diagonal=1)
    suppresses = overlaps & earlier & alive[:, :, None]                            # [B, j, i]
    kept = alive
    for _ in range(n):
        updated = alive & ~(suppresses & kept[:, :, None]).any(dim=1)
        if torch.equal(updated, kept):
            break
        kept = updated
    return kept


def iou_between(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[B, M, 4] x [B, N, 4] -> [B, M, N] IoU."""
    inter, union = _overlap(first, second)
    return inter / union.clamp(min=1e-9)


def _overlap(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Intersection and union areas, [B, M, N] each, with as few [B, M, N] temporaries as it takes."""
    def area(boxes: torch.Tensor) -> torch.Tensor:
        return (boxes[..., 2] - boxes[..., 0]).clamp(min=0) * (boxes[..., 3] - boxes[..., 1]).clamp(min=0)

    def span(low: int, high: int) -> torch.Tensor:
        return (torch.minimum(first[:, :, None, high], second[:, None, :, high])
                - torch.maximum(first[:, :, None, low], second[:, None, :, low])).clamp_(min=0)

    inter = span(0, 2).mul_(span(1, 3))
    union = (area(first)[:, :, None] + area(second)[:, None, :]).sub_(inter)
    return inter, union



def pairwise_iou(boxes: torch.Tensor) -> torch.Tensor:
    """[B, K, 4] -> [B, K, K] IoU."""
    return iou_between(boxes, boxes)
