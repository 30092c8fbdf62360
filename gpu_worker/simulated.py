"""`device: sim`: a simulated accelerator for sizing a deployment without a GPU.

Each batch sleeps for the latency a profile gives for its size (interpolated
linearly, extrapolated from the last two points), releasing the CPU as a real
GPU does, then returns a synthetic detector output of the spec's layout, so
post-processing stays real. Everything else in the stack is unchanged.
"""
from __future__ import annotations

import time
from typing import Mapping

import torch

from contract.settings import ModelSpec

# The story's batch-size table (ms per batch on its GPU).
STORY_PROFILE_MS = {1: 72.0, 4: 150.0, 8: 260.0, 16: 430.0}
OBJECTS_PER_IMAGE = 4


def profile_latency_s(profile_ms: Mapping[int, float], batch_size: int) -> float:
    """Latency of one batch, interpolated from {batch size: ms}."""
    points = sorted((int(size), float(ms)) for size, ms in profile_ms.items())
    if not points:
        raise ValueError("an empty latency profile")
    if len(points) == 1:
        return points[0][1] * batch_size / points[0][0] / 1000.0
    segments = list(zip(points, points[1:]))
    (s0, m0), (s1, m1) = next((seg for seg in segments if batch_size <= seg[1][0]), segments[-1])
    return max(0.0, m0 + (m1 - m0) * (batch_size - s0) / (s1 - s0)) / 1000.0


class SimulatedDetector(torch.nn.Module):
    def __init__(self, spec: ModelSpec, profile_ms: Mapping[int, float], seed: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.profile_ms = dict(profile_ms)
        self.generator = torch.Generator().manual_seed(seed)
        size = spec.input_size
        self.anchors = sum((size // stride) ** 2 for stride in (8, 16, 32))
        self.last_latency_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        self.last_latency_s = profile_latency_s(self.profile_ms, batch)
        time.sleep(self.last_latency_s)
        return self._synthetic_output(batch)

    def _synthetic_output(self, batch: int) -> torch.Tensor:
        """Background scores under any sane threshold, plus a few confident boxes per image."""
        classes, size, n = len(self.spec.labels), self.spec.input_size, self.anchors
        g = self.generator
        boxes = torch.rand(batch, n, 4, generator=g) * torch.tensor([size, size, size / 4, size / 4])
        scores = torch.rand(batch, n, classes, generator=g) * 0.1
        picked = torch.randint(0, n, (batch, OBJECTS_PER_IMAGE), generator=g)
        cls = torch.randint(0, classes, (batch, OBJECTS_PER_IMAGE), generator=g)
        rows = torch.arange(batch)[:, None].expand(-1, OBJECTS_PER_IMAGE)
        scores[rows, picked, cls] = 0.6 + 0.3 * torch.rand(batch, OBJECTS_PER_IMAGE, generator=g)
        if self.spec.layout == "yolov5":
            return torch.cat([boxes, torch.ones(batch, n, 1), scores], dim=2)
        return torch.cat([boxes, scores], dim=2).transpose(1, 2).contiguous()
