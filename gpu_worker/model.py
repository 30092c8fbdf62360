"""Loading the detector a spec names, and feeding it a batch of frames."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from contract.frames import Frame
from contract.settings import ModelSpec
from gpu_worker import tiny_yolo



class ModelLoadError(RuntimeError):
    """A model that cannot be served as its spec says."""


@dataclass
class LoadedModel:
    spec: ModelSpec
    module: torch.nn.Module
    device: torch.device
    simulated: bool = False

    def describe(self) -> dict[str, Any]:
        return {**self.spec.describe(), "device": "sim" if self.simulated else str(self.device),
                "simulated": self.simulated, "format": self.spec.format}


def load_for_device(spec: ModelSpec, requested: str, sim_profile_ms: Mapping[int, float]) -> LoadedModel:
    """`sim` gives the simulated accelerator; anything else a real device."""
    if requested == "sim":
        from gpu_worker.simulated import SimulatedDetector

        return LoadedModel(spec=spec, module=SimulatedDetector(spec, sim_profile_ms), device=torch.device("cpu"),
                           simulated=True)
    return load_model(spec, choose_device(requested))


def choose_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {requested!r} requested but CUDA is not available")
    return device


def load_model(spec: ModelSpec, device: torch.device) -> LoadedModel:
    if spec.format == "builtin":
        module = _load_builtin(spec).to(device).eval()
    elif spec.format == "export":
        module = _load_exported(spec, device)
    else:
        module = _load_torchscript(spec, device).eval()
    loaded = LoadedModel(spec=spec, module=module, device=device)
    _check_output(loaded)
    return loaded


def _load_builtin(spec: ModelSpec) -> torch.nn.Module:
    if spec.builtin != "tiny_yolo":
        raise ModelLoadError(f"unknown builtin model {spec.builtin!r}")
    if spec.layout != "yolov8":
        raise ModelLoadError("the builtin tiny_yolo emits the yolov8 layout")
    return tiny_yolo.build_random(len(spec.labels))


def _model_file(spec: ModelSpec) -> Path:
    path = Path(spec.path or "")
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    return path


def _load_torchscript(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    path = _model_file(spec)
    try:
        return torch.jit.load(str(path), map_location=device)
    except Exception as exc:
        raise ModelLoadError(f"cannot load TorchScript model {path}: {exc}") from exc


def _load_exported(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    """A torch.export program (.pt2). Exported with a dynamic batch dimension to serve batches."""
    path = _model_file(spec)
    try:
        return torch.export.load(str(path)).module().to(device)
    except Exception as exc:
        raise ModelLoadError(f"cannot load exported program {path}: {exc}") from exc


def _check_output(loaded: LoadedModel) -> None:
    """One dry run on a batch of two: the output must match the layout and the labels."""
    size = loaded.spec.input_size
    probe = torch.zeros(2, 3, size, size, device=loaded.device)
    try:
        with torch.inference_mode():
            output = loaded.module(probe)
    except Exception as exc:
        raise ModelLoadError(f"the model fails on a batch of 2 at {size}x{size} (a static batch size or "
                             f"another input size?): {str(exc)[:300]}") from exc
    if not isinstance(output, torch.Tensor) or output.dim() != 3 or output.shape[0] != 2:
        raise ModelLoadError(f"model output must be one 3-D tensor, got {_shape_of(output)}")
    classes = len(loaded.spec.labels)
    expected = 4 + classes if loaded.spec.layout == "yolov8" else 5 + classes
    actual = output.shape[1] if loaded.spec.layout == "yolov8" else output.shape[2]
    if actual != expected:
        raise ModelLoadError(
            f"layout {loaded.spec.layout} with {classes} labels expects {expected} values per box, "
            f"the model gives {actual} (output shape {tuple(output.shape)})")


def _shape_of(output: Any) -> str:
    return str(tuple(output.shape)) if isinstance(output, torch.Tensor) else type(output).__name__


class BatchAssembler:
    """Frames -> one normalised [B, 3, S, S] input on the device.

    The frames' contents are stacked into one staging buffer (pinned on CUDA,
    reused across batches) and cross to the device in one non-blocking copy;
    padding, conversion to float, channel order and normalisation then run on
    the device, once, for the whole batch.
    """

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.pinned = device.type == "cuda"
        self.staging = torch.empty(0, dtype=torch.uint8)
        mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1)
        std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1)
        self.gain = spec.scale / std
        self.bias = -mean / std

    def __call__(self, frames: Sequence[Frame]) -> torch.Tensor:
        sizes = [len(frame.pixels) for frame in frames]
        staging = self._staging(sum(sizes))
        host = staging.numpy()   # a view: numpy copies from the read-only frames without a torch wrapper
        offset = 0
        for frame, size in zip(frames, sizes):
            host[offset:offset + size] = np.frombuffer(frame.pixels, dtype=np.uint8)
            offset += size
        contents = staging[:offset].to(self.device, non_blocking=True)
        # Channels-first float canvas in the pad colour; each frame's content is written into its
        # place (the uint8 -> float conversion rides on that copy), then one in-place affine pass
        # normalises the whole batch: x * scale / std - mean / std.
        size = self.spec.input_size
        batch = torch.full((len(frames), 3, size, size), float(self.spec.pad_value), device=self.device)
        channels = [2, 1, 0] if self.spec.channel_order == "bgr" else [0, 1, 2]
        offset = 0
        for i, (frame, length) in enumerate(zip(frames, sizes)):
            h = frame.header
            content = contents[offset:offset + length].view(h.height, h.width, 3).permute(2, 0, 1)
            batch[i, :, h.pad_top:h.pad_top + h.height, h.pad_left:h.pad_left + h.width] = content[channels]
            offset += length
        return batch.mul_(self.gain).add_(self.bias)

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least nbytes; the caller synchronises before the next batch reuses it."""
        if self.staging.numel() < nbytes:
            self.staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return self.staging
