"""What a batch is between the stage thread and the device: its staging slot, its parameters, its answer.

Every device (gpu_worker.devices' TorchDevice, gpu_worker.simulated's SimulatedDevice) stages the same
way (`HostStaging`) and answers the same `DeviceOutput`; the `Device` protocol is what the worker's
threads call.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from contract.frames import CHANNELS, MAPPING_FIELDS, Frame, FrameHeader
from contract.settings.models import ModelSpec
from gpu_worker.postprocess import ROW_COLUMNS

# Per frame, what post-processing needs: its options, then how the letterbox placed it.
PARAM_COLUMNS = ("conf", "iou", "max_det", *MAPPING_FIELDS)
# Per detection, one row of the array `run()` returns, grouped by image in batch order.
DETECTION_COLUMNS = ROW_COLUMNS
# Batches that can hold a slot at once: one being staged, one waiting, one on the device.
SLOTS = 3


@dataclass
class StagingSlot:
    """Host (and on CUDA, device) buffers for one batch in flight."""

    host: torch.Tensor  # uint8 contents, pinned on CUDA
    params: torch.Tensor  # float64 [max batch, len(PARAM_COLUMNS)], pinned on CUDA
    device_contents: torch.Tensor  # the contents where the model runs (the host buffer itself on CPU)
    device_params: torch.Tensor

    @property
    def host_bytes(self) -> np.ndarray:
        return self.host.numpy()


class StagingSlots:
    """A fixed set of slots, allocated once at full size; acquire() waits for a free one."""

    def __init__(self, count: int, max_batch: int, input_size: int, device: torch.device) -> None:
        if count < 1 or max_batch < 1:
            raise ValueError("need at least one slot of at least one frame")
        pinned = device.type == "cuda"
        nbytes = max_batch * input_size * input_size * CHANNELS
        self.max_batch = max_batch
        self.count = count
        self._free: queue.Queue[StagingSlot] = queue.Queue()
        for _ in range(count):
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            params = torch.empty(max_batch, len(PARAM_COLUMNS), dtype=torch.float64, pin_memory=pinned)
            on_device = (
                (torch.empty_like(host, device=device), torch.empty_like(params, device=device))
                if pinned
                else (host, params)
            )
            self._free.put(StagingSlot(host, params, *on_device))

    def acquire(self) -> StagingSlot:
        return self._free.get()

    def release(self, slot: StagingSlot) -> None:
        self._free.put(slot)


@dataclass
class Staged:
    """A batch's frames on the host, in their slot, ready for the device."""

    frames: list[Frame]
    sizes: list[int]  # content bytes per frame
    slot: StagingSlot
    ready: Any = None  # CUDA event: the upload is done

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def params(self) -> np.ndarray:
        return self.slot.params[: len(self.frames)].numpy()


@dataclass
class DeviceOutput:
    """One batch's answer on the host."""

    detections: np.ndarray  # [K, len(DETECTION_COLUMNS)] float64, grouped by image in batch order
    device_s: float  # the device's busy time for the batch
    infer_ms: float  # canvas + forward
    postprocess_ms: float  # post-processing + the copy back
    errors: dict[int, dict[str, str]] = field(default_factory=dict)  # frame index -> error, failed alone


class Device(Protocol):
    spec: ModelSpec
    name: str  # cpu, cuda:0, sim
    identity: str  # what tells this device from others on the host: the GPU's UUID on CUDA
    simulated: bool

    def stage(self, frames: Sequence[Frame]) -> Staged: ...
    def run(self, staged: Staged) -> DeviceOutput: ...
    def discard(self, staged: Staged) -> None: ...
    def warm_up(self, max_batch: int) -> Iterator[list[Frame]]: ...
    def describe(self) -> dict[str, Any]: ...
    def utilisation(self) -> float | None: ...


def warm_up_frames(spec: ModelSpec, count: int) -> list[Frame]:
    """Frames of a landscape image filling the input's width, for runs before serving."""
    size = spec.input_size
    height = max(1, size * 3 // 4)
    header = FrameHeader(
        job_id="warm-up",
        width=size,
        height=height,
        pad_left=0,
        pad_top=(size - height) // 2,
        scale_x=1.0,
        scale_y=1.0,
        orig_width=size,
        orig_height=height,
        deadline_at=0.0,
    )
    pixels = memoryview(
        bytearray(np.random.default_rng(0).integers(0, 256, size * height * CHANNELS, dtype=np.uint8).tobytes())
    )
    return [Frame(header=header, pixels=pixels)] * count


def frame_params(frames: Sequence[Frame], spec: ModelSpec) -> list[list[float]]:
    """Rows of PARAM_COLUMNS: each frame's options (else the spec's defaults) and geometry."""
    rows = []
    for frame in frames:
        h, options = frame.header, frame.header.options
        rows.append(
            [
                options.get("conf", spec.conf),
                options.get("iou", spec.iou),
                options.get("max_det", spec.max_det),
                *(getattr(h, name) for name in MAPPING_FIELDS),
            ]
        )
    return rows


class HostStaging:
    """The host half of staging, shared by every device: contents and params into a slot."""

    def __init__(self, spec: ModelSpec, slots: StagingSlots) -> None:
        self.spec = spec
        self.slots = slots

    def fill(self, frames: Sequence[Frame]) -> Staged:
        if len(frames) > self.slots.max_batch:
            raise ValueError(f"a batch of {len(frames)} frames exceeds the staging size {self.slots.max_batch}")
        slot = self.slots.acquire()
        host, offset, sizes = slot.host_bytes, 0, []
        for frame in frames:
            size = len(frame.pixels)
            host[offset : offset + size] = np.frombuffer(frame.pixels, dtype=np.uint8)
            offset += size
            sizes.append(size)
        if frames:
            slot.params[: len(frames)] = torch.tensor(frame_params(frames, self.spec), dtype=torch.float64)
        return Staged(list(frames), sizes, slot)

    def release(self, staged: Staged) -> None:
        """The device is done with the batch: its slot can take another."""
        self.slots.release(staged.slot)
