"""Batched, vectorised post-processing: confidence filter, box decode,
class-aware NMS, max_det, and the letterbox undone into original pixels.

No per-box Python loop on the hot path: every step is a tensor op over the
whole batch. Per-image `conf`, `iou` and `max_det` are tensors, so each job
keeps its own options inside one batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # torchvision is optional: it does not import beside every torch build
    from torchvision.ops import batched_nms as _tv_batched_nms
except Exception:  # pragma: no cover - depends on the environment
    _tv_batched_nms = None


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
                max_candidates: int = 1000, use_torchvision: bool | None = None) -> Detections:
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
    keep = nms_keep(boxes, top_scores, classes, valid, thresholds.iou, use_torchvision)
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


def nms_keep(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor,
             iou: torch.Tensor, use_torchvision: bool | None = None) -> torch.Tensor:
    """Class-aware greedy NMS per image. Inputs [B, K, ...] sorted by score, best first.

    Returns a [B, K] keep mask. torchvision's kernel when it imports (or when
    asked), else our own; both give the same boxes.
    """
    if use_torchvision is None:
        use_torchvision = _tv_batched_nms is not None
    if use_torchvision:
        return _nms_keep_torchvision(boxes, scores, classes, valid, iou)
    return _nms_keep_matrix(boxes, classes, valid, iou)


def pairwise_iou(boxes: torch.Tensor) -> torch.Tensor:
    """[B, K, 4] -> [B, K, K] IoU."""
    area = (boxes[..., 2] - boxes[..., 0]).clamp(min=0) * (boxes[..., 3] - boxes[..., 1]).clamp(min=0)
    top_left = torch.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])
    bottom_right = torch.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(dim=-1)
    union = area[:, :, None] + area[:, None, :] - inter
    return inter / union.clamp(min=1e-9)


def _nms_keep_matrix(boxes: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor,
                     iou: torch.Tensor) -> torch.Tensor:
    """Greedy NMS as a fixed point over the IoU matrix (Cluster-NMS).

    keep[i] = valid[i] and no kept j < i of the same class overlaps i by more
    than the threshold. Iterating from keep = valid settles on exactly the
    greedy answer; each round is one batched matrix op, and rounds are few
    (the length of the longest suppression chain).
    """
    k = boxes.shape[1]
    if k == 0:
        return valid.clone()
    same_class = classes[:, :, None] == classes[:, None, :]
    earlier = torch.ones(k, k, dtype=torch.bool, device=boxes.device).triu(diagonal=1)
    suppresses = (pairwise_iou(boxes) > iou[:, None, None]) & same_class & earlier  # [B, j, i]
    suppresses &= valid[:, :, None]
    keep = valid.clone()
    for _ in range(k):
        suppressed = (suppresses & keep[:, :, None]).any(dim=1)
        updated = valid & ~suppressed
        if torch.equal(updated, keep):
            break
        keep = updated
    return keep


def _nms_keep_torchvision(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor,
                          valid: torch.Tensor, iou: torch.Tensor) -> torch.Tensor:
    keep = torch.zeros_like(valid)
    for b in range(boxes.shape[0]):  # per image: torchvision takes one threshold per call
        idx = valid[b].nonzero(as_tuple=True)[0]
        kept = _tv_batched_nms(boxes[b, idx], scores[b, idx], classes[b, idx], float(iou[b]))
        keep[b, idx[kept]] = True
    return keep
