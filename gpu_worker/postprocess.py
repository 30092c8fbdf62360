"""Batched, vectorised post-processing: confidence filter, box decode,
class-aware NMS, max_det, and the letterbox undone into original pixels.

No per-box Python loop on the hot path: every step is a tensor op over the
whole batch. Per-image `conf`, `iou` and `max_det` are tensors, so each job
keeps its own options inside one batch.

Host reads are few because each one is a sync on CUDA (the host waits for
everything queued before it): a batch reads how many candidates its fullest
image has (the size of the NMS) and its emptiest, one flag per NMS chunk settled
(converged, may the scan stop), and its answer, once (`postprocess_rows`). A
typical batch - its candidates in one chunk - costs three. One frame whose
options give it many times its neighbours' candidates is settled in an NMS of
its own (`nms_groups`): a read of every image's count more, and one flag per
chunk of each group. `tests.support.HostReads` counts them on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# How many candidates (in score order) are settled together: each chunk is resolved exactly, then
# suppresses every later candidate in one matrix op. Memory is O(B * NMS_CHUNK * K), not O(B * K^2).
NMS_CHUNK = 64
# nms_groups settles together images whose candidates fill up to this many chunks, whatever their counts.
NARROWEST_GROUP = 2
# Rounds of a chunk's fixed point run between two looks at whether it has converged: the suppression
# chains of real detections are short (one or two links), so one look usually settles a chunk.
ROUNDS_PER_LOOK = 4


@dataclass(frozen=True)
class Geometry:
    """Per image, how the letterbox placed the original: [B] tensors of contract.frames.MAPPING_FIELDS
    (a test keeps the two in step)."""

    pad_left: torch.Tensor
    pad_top: torch.Tensor
    scale_x: torch.Tensor
    scale_y: torch.Tensor
    orig_width: torch.Tensor
    orig_height: torch.Tensor


@dataclass(frozen=True)
class Thresholds:
    conf: torch.Tensor  # [B] float
    iou: torch.Tensor  # [B] float
    max_det: torch.Tensor  # [B] int


@dataclass(frozen=True)
class Detections:
    """Flat over the batch: row i belongs to image `image_index[i]`."""

    image_index: torch.Tensor  # [K] long
    boxes: torch.Tensor  # [K, 4] x1, y1, x2, y2 in original pixels
    scores: torch.Tensor  # [K]
    class_ids: torch.Tensor  # [K] long


def split_layout(output: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Model output -> (cxcywh [B, N, 4], class scores [B, N, C])."""
    if output.dim() != 3:
        raise ValueError(f"detector output must be 3-D, got shape {tuple(output.shape)}")
    if layout == "yolov8":  # [B, 4 + C, N]
        rows = output.transpose(1, 2)
        return rows[..., :4], rows[..., 4:]
    if layout == "yolov5":  # [B, N, 5 + C], objectness at 4
        return output[..., :4], output[..., 5:] * output[..., 4:5]
    raise ValueError(f"unknown layout {layout!r}")


def cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    centre, size = boxes[..., :2], boxes[..., 2:4] / 2
    return torch.cat([centre - size, centre + size], dim=-1)


@dataclass(frozen=True)
class Candidates:
    """Some images' best candidates, [b, k, ...] in score order, and which of them NMS keeps."""

    images: torch.Tensor | None  # [b] their places in the batch; None: the whole batch, in order
    boxes: torch.Tensor  # [b, k, 4] x1, y1, x2, y2 in input pixels
    scores: torch.Tensor  # [b, k]
    class_ids: torch.Tensor  # [b, k] long
    keep: torch.Tensor  # [b, k] bool

    def image_index(self) -> torch.Tensor:
        """[b] the batch place of each of these images."""
        if self.images is not None:
            return self.images
        return torch.arange(self.keep.shape[0], device=self.keep.device)


def nms_groups(counts: list[int]) -> list[tuple[list[int], int]]:
    """The batch's images grouped for NMS: (the images in batch order, the group's width: its widest image's
    count), narrowest group first. No image is in a group more than twice as wide as itself in chunks
    (or than NARROWEST_GROUP's twice).

    An NMS costs its images times its width squared, so one image with a thousand candidates in a batch of
    eight made the seven others' NMS a thousand wide too. Grouped, an image's share is at most four times its
    cost alone, whatever another frame's options; images of like widths (any normal batch) stay one NMS."""
    groups: list[list[int]] = []
    for image in sorted(range(len(counts)), key=counts.__getitem__):
        if groups and _chunks(counts[image]) <= 2 * _chunks(counts[groups[-1][0]]):
            groups[-1].append(image)
        else:
            groups.append([image])
    return [(sorted(images), max(counts[i] for i in images)) for images in groups]


def _chunks(count: int) -> int:
    """How wide an image's candidates make an NMS, in chunks, as nms_groups judges it: any count of up to
    NARROWEST_GROUP chunks is as narrow as that, so a normal batch (a frame with no object beside one of a
    hundred candidates) stays one NMS, with no read more."""
    return max(NARROWEST_GROUP, -(-count // NMS_CHUNK))


def select(output: torch.Tensor, layout: str, thresholds: Thresholds, max_candidates: int = 1000) -> list[Candidates]:
    """Confidence filter, top candidates per image, class-aware NMS, max_det: all on the output's device. One
    Candidates for the batch, or one per group of nms_groups when its images' widths are far apart."""
    cxcywh, class_scores = split_layout(output.float(), layout)
    scores, class_ids = class_scores.max(dim=-1)  # [B, N]
    below = scores < thresholds.conf[:, None]
    scores = scores.masked_fill(below, -1.0)
    # NMS costs k^2: take no more candidates than the fullest image has above its threshold. One host read
    # says the fullest's count and the emptiest's; only when they are far apart are the others' read too.
    counts = (~below).sum(dim=1).clamp_(max=max_candidates)
    span = max_candidates + 1
    k, fewest = divmod(int(counts.max() * span + counts.min()), span) if len(scores) else (0, 0)
    if _chunks(k) <= 2 * _chunks(fewest):
        return [_select_top(cxcywh, scores, class_ids, thresholds, k, None)]
    found = []
    for images, width in nms_groups(counts.tolist()):
        index = torch.tensor(images, device=scores.device)  # the reads above left nothing queued to wait for
        limits = Thresholds(thresholds.conf[index], thresholds.iou[index], thresholds.max_det[index])
        found.append(_select_top(cxcywh[index], scores[index], class_ids[index], limits, width, index))
    return found


def _select_top(
    cxcywh: torch.Tensor,
    scores: torch.Tensor,
    class_ids: torch.Tensor,
    thresholds: Thresholds,
    k: int,
    images: torch.Tensor | None,
) -> Candidates:
    top_scores, top_index = scores.topk(k, dim=1)  # sorted, best first
    valid = top_scores >= 0
    boxes = cxcywh_to_xyxy(torch.gather(cxcywh, 1, top_index[..., None].expand(-1, -1, 4)))
    classes = torch.gather(class_ids, 1, top_index)
    keep = nms_keep(boxes, classes, valid, thresholds.iou, thresholds.max_det)
    keep &= keep.cumsum(dim=1) <= thresholds.max_det[:, None]
    return Candidates(images, boxes, top_scores, classes, keep)


def postprocess(
    output: torch.Tensor, layout: str, thresholds: Thresholds, geometry: Geometry, max_candidates: int = 1000
) -> Detections:
    """The kept detections as tensors on the output's device."""
    parts = []
    for found in select(output, layout, thresholds, max_candidates):
        row, slot = found.keep.nonzero(as_tuple=True)
        image_index = found.image_index()[row]
        parts.append(
            (
                image_index,
                unletterbox(found.boxes[row, slot], geometry, image_index),
                found.scores[row, slot],
                found.class_ids[row, slot],
            )
        )
    image_index, boxes, scores, class_ids = (torch.cat(column) for column in zip(*parts))
    if len(parts) > 1:  # grouped: back in batch order, each image's rows as NMS kept them
        order = torch.sort(image_index, stable=True).indices
        image_index, boxes, scores, class_ids = image_index[order], boxes[order], scores[order], class_ids[order]
    return Detections(image_index=image_index, boxes=boxes, scores=scores, class_ids=class_ids)


# Per detection, one row of what `postprocess_rows` returns.
ROW_COLUMNS = ("image", "x1", "y1", "x2", "y2", "score", "class_id")


def postprocess_rows(
    output: torch.Tensor, layout: str, thresholds: Thresholds, geometry: Geometry, max_candidates: int = 1000
) -> np.ndarray:
    """The kept detections on the host, as rows of ROW_COLUMNS (float64) grouped by image in batch order.

    Every candidate slot is mapped back to original pixels on the device and the whole [B, k] block (each
    NMS group's) comes to the host in one copy, with its keep flag; the host drops what NMS did not keep. That
    is one host read where picking the kept rows on the device would take two (their count, then the rows)."""
    blocks = []
    for found in select(output, layout, thresholds, max_candidates):
        images, k = found.keep.shape
        image_index = found.image_index()[:, None].expand(images, k).reshape(-1)
        boxes = unletterbox(found.boxes.reshape(-1, 4), geometry, image_index)
        columns = (image_index[:, None], boxes, found.scores.reshape(-1, 1), found.class_ids.reshape(-1, 1))
        blocks.append(torch.cat([*(column.double() for column in columns), found.keep.reshape(-1, 1).double()], dim=1))
    on_host = (torch.cat(blocks) if len(blocks) > 1 else blocks[0]).cpu().numpy()
    kept = on_host[on_host[:, -1] > 0, :-1]
    if len(blocks) > 1:  # grouped: back in batch order, each image's rows as NMS kept them
        kept = kept[np.argsort(kept[:, 0], kind="stable")]
    return kept


def unletterbox(boxes: torch.Tensor, geometry: Geometry, image_index: torch.Tensor) -> torch.Tensor:
    """Input-pixel boxes [K, 4] -> original-image pixels, clipped to the image."""
    g = {
        name: getattr(geometry, name).to(boxes.device, torch.float32)[image_index]
        for name in ("pad_left", "pad_top", "scale_x", "scale_y", "orig_width", "orig_height")
    }
    x = (boxes[:, 0::2] - g["pad_left"][:, None]) / g["scale_x"][:, None]  # slices: a list index would be
    y = (boxes[:, 1::2] - g["pad_top"][:, None]) / g["scale_y"][:, None]  # copied to the device each time
    x = torch.minimum(x.clamp(min=0), g["orig_width"][:, None])
    y = torch.minimum(y.clamp(min=0), g["orig_height"][:, None])
    return torch.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], dim=1)


def nms_keep(
    boxes: torch.Tensor,
    classes: torch.Tensor,
    valid: torch.Tensor,
    iou: torch.Tensor,
    max_det: torch.Tensor | None = None,
    chunk: int = NMS_CHUNK,
) -> torch.Tensor:
    """Class-aware greedy NMS per image: a [B, K] keep mask. Inputs [B, K, ...] sorted by score, best first.

    One NMS for the whole batch, keyed by (image, class): boxes of different images or classes never
    suppress each other. Exactly greedy NMS, in chunks of `chunk` candidates taken in score order: a
    chunk's own boxes are settled by a fixed point over their small IoU matrix (Cluster-NMS: as many
    rounds as the longest suppression chain inside the chunk, at most `chunk`), then the chunk's kept
    boxes suppress every later candidate at once. The scan stops once no later candidate is left or
    every image holds `max_det` kept boxes (later ones can no longer reach the answer): at `conf=0`,
    with many times `max_det` candidates, it settles a few chunks, not all.

    Host reads: one per chunk (whether it has settled, and where the next chunk starts: at the next
    candidate still alive, or nowhere), plus one per further ROUNDS_PER_LOOK rounds when a chain inside
    the chunk is longer than that.
    """
    batch, k = valid.shape
    keep = torch.zeros_like(valid)
    removed = ~valid
    start = 0
    while start < k:
        end = min(start + chunk, k)
        inter, union = overlap(boxes[:, start:end], boxes[:, start:])
        # IoU > t  <=>  inter > t * union: no division over the [B, chunk, K] block
        overlaps = (inter > union.mul_(iou[:, None, None])) & (
            classes[:, start:end, None] == classes[:, None, start:]
        )  # [B, chunk, K - start]
        own, later = overlaps[:, :, : end - start], overlaps[:, :, end - start :]
        settling = _ChunkSettling(own, ~removed[:, start:end])
        while True:
            kept, settled = settling.advance()
            # What the scan does next if `kept` is final, worked out before the chunk's one host read:
            # where the next candidate still alive in some image is (k: none, the scan is over).
            removed_later = removed[:, end:] | (later & kept[:, :, None]).any(dim=1)
            next_start = _first_alive(removed_later, offset=end)
            if max_det is not None:
                full = (keep[:, :start].sum(dim=1) + kept.sum(dim=1) >= max_det).all()
                next_start = torch.where(full, k, next_start)
            read = int(next_start * 2 + settled.int())  # the chunk's one host read
            if read & 1:
                break
        keep[:, start:end] = kept
        removed[:, end:] = removed_later
        start = read >> 1
    return keep


def _first_alive(removed: torch.Tensor, offset: int) -> torch.Tensor:
    """Where, counting from `offset`, the first candidate still alive in some image is; offset +
    removed.shape[1] when there is none. A tensor: nothing is read here."""
    alive = (~removed).any(dim=0)
    if alive.numel() == 0:  # a fill on the device: torch.tensor(offset, device=...) would be a synchronous copy
        return torch.full((), offset, dtype=torch.long, device=removed.device)
    return torch.where(alive.any(), offset + alive.int().argmax(), offset + alive.numel())


class _ChunkSettling:
    """Greedy NMS among one chunk's candidates ([B, n, n] overlaps, [B, n] alive): kept[i] = alive[i]
    and no kept j < i overlaps i. Iterating from kept = alive settles on exactly the greedy answer
    within n rounds (round t fixes candidate t for good), and that answer is the map's only fixed
    point, so a round that changes nothing means it is reached. `advance()` runs a few rounds and
    says, as a tensor the caller reads when it reads anything else, whether the last changed nothing."""

    def __init__(self, overlaps: torch.Tensor, alive: torch.Tensor, rounds_per_look: int = ROUNDS_PER_LOOK) -> None:
        n = alive.shape[1]
        earlier = torch.ones(n, n, dtype=torch.bool, device=alive.device).triu(diagonal=1)
        self.suppresses = overlaps & earlier & alive[:, :, None]  # [B, j, i]
        self.alive, self.kept = alive, alive
        self.rounds_left, self.rounds_per_look = n, rounds_per_look

    def advance(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rounds_left <= 0:  # n rounds always settle n candidates
            return self.kept, torch.ones((), dtype=torch.bool, device=self.alive.device)
        for _ in range(min(self.rounds_per_look, self.rounds_left)):
            previous = self.kept
            self.kept = self.alive & ~(self.suppresses & previous[:, :, None]).any(dim=1)
            self.rounds_left -= 1
        settled = (
            (self.kept == previous).all()
            if self.rounds_left > 0
            else torch.ones((), dtype=torch.bool, device=self.alive.device)
        )
        return self.kept, settled


def overlap(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, M, 4] x [B, N, 4] -> intersection and union areas, [B, M, N] each (IoU > t is inter > t * union),
    with as few [B, M, N] temporaries as it takes."""

    def area(boxes: torch.Tensor) -> torch.Tensor:
        return (boxes[..., 2] - boxes[..., 0]).clamp(min=0) * (boxes[..., 3] - boxes[..., 1]).clamp(min=0)

    def span(low: int, high: int) -> torch.Tensor:
        return (
            torch.minimum(first[:, :, None, high], second[:, None, :, high])
            - torch.maximum(first[:, :, None, low], second[:, None, :, low])
        ).clamp_(min=0)

    inter = span(0, 2).mul_(span(1, 3))
    union = (area(first)[:, :, None] + area(second)[:, None, :]).sub_(inter)
    return inter, union
