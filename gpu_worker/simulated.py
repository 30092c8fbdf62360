"""`device: sim`: a simulated accelerator, for sizing a deployment without a GPU.

Honest about what a GPU would take off the host. The device's part of a batch
(the upload, the padded and normalised canvas, the forward, the post-processing
kernels) is one sleep of the latency the profile gives for its size
(interpolated linearly, extrapolated from the last two points), during which
the thread holds no CPU and no GIL, as a thread waiting on a GPU would. The
host's part runs for real, exactly as on a GPU: popping and unpacking frames,
the Redis round trips, the copy into the staging slot, the detections coming
back as one array (a few synthetic objects per image, inside the original
image, honouring each job's `conf` and `max_det`), the result documents and
the writes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from contract.frames import Frame
from contract.settings.models import ModelSpec
from gpu_worker.staging import (
    DETECTION_COLUMNS,
    PARAM_COLUMNS,
    SLOTS,
    DeviceOutput,
    HostStaging,
    Staged,
    StagingSlots,
    warm_up_frames,
)

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


class SimulatedDevice:
    simulated = True
    name = "sim"
    identity = "sim"

    def __init__(
        self, spec: ModelSpec, profile_ms: Mapping[int, float], max_batch: int, slots: int = SLOTS, seed: int = 0
    ) -> None:
        profile_latency_s(profile_ms, 1)  # refuse an empty profile now, not at the first batch
        self.spec = spec
        self.profile_ms = dict(profile_ms)
        self.host = HostStaging(spec, StagingSlots(slots, max_batch, spec.input_size, torch.device("cpu")))
        self.rng = np.random.default_rng(seed)
        self.patterns = detection_patterns(self.rng, len(spec.labels))

    def describe(self) -> dict[str, Any]:
        return {
            **self.spec.describe(),
            "device": "sim",
            "simulated": True,
            "format": self.spec.format,
            "sim_latency_ms": {str(size): ms for size, ms in sorted(self.profile_ms.items())},
        }

    def stage(self, frames: Sequence[Frame]) -> Staged:
        return self.host.fill(frames)

    def discard(self, staged: Staged) -> None:
        self.host.release(staged)

    def utilisation(self) -> None:
        return None

    def warm_up(self, max_batch: int) -> Iterator[list[Frame]]:
        """The host's part once per slot at the full batch (the slots' pages touched), no sleeping."""
        frames = warm_up_frames(self.spec, max_batch)
        staged = [self.stage(frames) for _ in range(self.host.slots.count)]
        for batch in staged:
            self.synthetic_detections(batch.params)
            self.host.release(batch)
        yield frames

    def run(self, staged: Staged) -> DeviceOutput:
        """The profile's latency for the batch, with its synthetic detections made inside it."""
        started = time.perf_counter()
        latency = profile_latency_s(self.profile_ms, len(staged))
        try:
            detections = self.synthetic_detections(staged.params)
        finally:
            self.host.release(staged)
        remaining = started + latency - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return DeviceOutput(detections, latency, latency * 1000.0, 0.0)

    def synthetic_detections(self, params: np.ndarray) -> np.ndarray:
        """OBJECTS_PER_IMAGE boxes inside each original image, best first, cut by conf and max_det."""
        count, n = len(params), OBJECTS_PER_IMAGE
        chosen = self.patterns[self.rng.integers(0, len(self.patterns), count)]  # [count, n, 6]
        conf, max_det = params[:, _CONF : _CONF + 1], params[:, _MAX_DET : _MAX_DET + 1]
        image, slot = np.nonzero((chosen[..., 4] >= conf) & (np.arange(n)[None, :] < max_det))
        rows = np.empty((len(image), len(DETECTION_COLUMNS)))
        rows[:, 0] = image
        rows[:, 1:5] = chosen[image, slot, :4] * params[image][:, _SIZE]
        rows[:, 5:] = chosen[image, slot, 4:]
        return rows


def detection_patterns(rng: np.random.Generator, labels: int, count: int = 64) -> np.ndarray:
    """[count, OBJECTS_PER_IMAGE, 6]: boxes as fractions of the image (x1, y1, x2, y2), a score
    (best first) and a class, drawn once so that each batch only picks and scales them."""
    n = OBJECTS_PER_IMAGE
    centre, half = rng.random((count, n, 2)), 0.03 + 0.1 * rng.random((count, n, 2))
    boxes = np.concatenate([np.clip(centre - half, 0, 1), np.clip(centre + half, 0, 1)], axis=-1)
    scores = -np.sort(-(0.6 + 0.3 * rng.random((count, n))), axis=1)
    classes = rng.integers(0, max(1, labels), (count, n))
    return np.concatenate([boxes, scores[..., None], classes[..., None]], axis=-1)


_CONF, _MAX_DET = PARAM_COLUMNS.index("conf"), PARAM_COLUMNS.index("max_det")
_SIZE = [PARAM_COLUMNS.index(name) for name in ("orig_width", "orig_height", "orig_width", "orig_height")]
