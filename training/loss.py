"""Training loss for the anchor-free TinyYolo head: FCOS-style assignment with
centre sampling, quality focal loss on IoU-aware class targets, GIoU boxes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from gpu_worker.tiny_yolo import cell_centres

CENTRE_RADIUS = 2.5


def level_ranges(strides: Sequence[int]) -> list[tuple[float, float]]:
    """Which object sizes each level regresses (by the largest l/t/r/b distance)."""
    limits = [0.0] + [4.0 * s for s in strides[1:]] + [float("inf")]
    return [(limits[i], limits[i + 1]) for i in range(len(strides))]


def anchor_grid(shapes: Sequence[tuple[int, int]], strides: Sequence[int], device) -> tuple[torch.Tensor, ...]:
    """Cell centres [N, 2], strides [N] and regression ranges [N, 2] for all levels."""
    centres, cell_strides, ranges = [], [], []
    for (height, width), stride, (low, high) in zip(shapes, strides, level_ranges(strides)):
        c = cell_centres(height, width, stride, device)
        centres.append(c)
        cell_strides.append(torch.full((len(c),), float(stride), device=device))
        ranges.append(torch.tensor([[low, high]], device=device).expand(len(c), 2))
    return torch.cat(centres), torch.cat(cell_strides), torch.cat(ranges)


def assign(centres: torch.Tensor, strides: torch.Tensor, ranges: torch.Tensor, gt_boxes: torch.Tensor) -> torch.Tensor:
    """For each cell, the index of the object it must predict, or -1."""
    n = len(centres)
    if len(gt_boxes) == 0:
        return torch.full((n,), -1, dtype=torch.long, device=centres.device)
    x, y = centres[:, 0:1], centres[:, 1:2]
    l, t = x - gt_boxes[:, 0], y - gt_boxes[:, 1]
    r, b = gt_boxes[:, 2] - x, gt_boxes[:, 3] - y
    ltrb = torch.stack([l, t, r, b], dim=2)  # [N, M, 4]
    inside = ltrb.amin(dim=2) > 0
    gcx, gcy = (gt_boxes[:, 0] + gt_boxes[:, 2]) / 2, (gt_boxes[:, 1] + gt_boxes[:, 3]) / 2
    radius = CENTRE_RADIUS * strides[:, None]
    near_centre = ((x - gcx).abs() < radius) & ((y - gcy).abs() < radius)
    reach = ltrb.amax(dim=2)
    in_range = (reach >= ranges[:, 0:1]) & (reach <= ranges[:, 1:2])
    ok = inside & near_centre & in_range
    area = (gt_boxes[:, 2] - gt_boxes[:, 0]) * (gt_boxes[:, 3] - gt_boxes[:, 1])
    cost = torch.where(ok, area[None, :].expand(n, -1), torch.full_like(reach, float("inf")))
    best_cost, best = cost.min(dim=1)
    matched = torch.where(torch.isfinite(best_cost), best, torch.full_like(best, -1))
    return _rescue_unmatched(matched, centres, gt_boxes, inside)


def _rescue_unmatched(matched, centres, gt_boxes, inside) -> torch.Tensor:
    """An object no cell took gets the free cell inside it nearest its centre."""
    for j in range(len(gt_boxes)):
        if (matched == j).any():
            continue
        gcx, gcy = (gt_boxes[j, 0] + gt_boxes[j, 2]) / 2, (gt_boxes[j, 1] + gt_boxes[j, 3]) / 2
        distance = (centres[:, 0] - gcx) ** 2 + (centres[:, 1] - gcy) ** 2
        distance = torch.where(inside[:, j] & (matched < 0), distance, torch.full_like(distance, float("inf")))
        if torch.isfinite(distance.min()):
            matched[distance.argmin()] = j
    return matched


def aligned_giou(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IoU and GIoU of matching rows of two [K, 4] xyxy tensors."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    inter = (torch.minimum(a[:, 2:], b[:, 2:]) - torch.maximum(a[:, :2], b[:, :2])).clamp(min=0).prod(dim=1)
    union = area_a + area_b - inter
    iou = inter / union.clamp(min=1e-6)
    hull = (torch.maximum(a[:, 2:], b[:, 2:]) - torch.minimum(a[:, :2], b[:, :2])).clamp(min=0).prod(dim=1)
    return iou, iou - (hull - union) / hull.clamp(min=1e-6)


def detection_loss(
    raw: list[torch.Tensor],
    strides: Sequence[int],
    targets: list[tuple[torch.Tensor, torch.Tensor]],
    box_weight: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """raw: per level [B, 4 + C, H, W]; targets: per image (boxes [M, 4] xyxy, classes [M])."""
    device = raw[0].device
    shapes = [(r.shape[2], r.shape[3]) for r in raw]
    centres, cell_strides, ranges = anchor_grid(shapes, strides, device)
    flat = torch.cat([r.flatten(2) for r in raw], dim=2).transpose(1, 2)  # [B, N, 4 + C]
    dist = F.softplus(flat[..., :4]) * cell_strides[None, :, None]
    pred_boxes = torch.cat([centres[None] - dist[..., :2], centres[None] + dist[..., 2:]], dim=2)
    logits = flat[..., 4:]
    cls_target = torch.zeros_like(logits)
    box_losses, ious = [], []
    for i, (gt_boxes, gt_classes) in enumerate(targets):
        matched = assign(centres, cell_strides, ranges, gt_boxes)
        positive = matched >= 0
        if not positive.any():
            continue
        target_boxes = gt_boxes[matched[positive]]
        iou, giou = aligned_giou(pred_boxes[i, positive], target_boxes)
        box_losses.append(1.0 - giou)
        ious.append(iou)
        cls_target[i, positive, gt_classes[matched[positive]]] = iou.detach().clamp(min=0.05)
    num_pos = max(1, sum(len(v) for v in box_losses))
    probs = logits.sigmoid()
    quality_focal = F.binary_cross_entropy_with_logits(logits, cls_target, reduction="none")
    cls_loss = (quality_focal * (probs - cls_target).abs().pow(2)).sum() / num_pos
    box_loss = torch.cat(box_losses).sum() / num_pos if box_losses else logits.sum() * 0
    mean_iou = torch.cat(ious).mean().item() if ious else 0.0
    return cls_loss + box_weight * box_loss, {"cls": cls_loss.item(), "box": box_loss.item(), "iou": mean_iou}
