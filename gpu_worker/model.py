"""Loading the detector a spec names, and feeding it a batch of frames."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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

    def describe(self) -> dict[str, Any]:
        return {**self.spec.describe(), "device": str(self.device), "simulated": False, "format": self.spec.format}


def choose_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {requested!r}: expected auto, cpu, cuda, cuda:N or sim") from exc
    if device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {requested!r}: expected auto, cpu, cuda, cuda:N or sim")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {requested!r} requested but CUDA is not available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ModelLoadError(f"device {requested!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
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
    """Frames' contents, already where the model runs -> one normalised [B, 3, S, S] canvas.

    Padding, conversion to float, channel order and normalisation run there,
    once, for the whole batch: a channels-first canvas in the pad colour, each
    frame's content written into its place (the uint8 -> float conversion
    rides on that copy), then one in-place affine pass, x * scale / std - mean / std.
    """

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1)
        std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1)
        self.gain = spec.scale / std
        self.bias = -mean / std
        self.bgr = spec.channel_order == "bgr"

    def __call__(self, contents: torch.Tensor, frames: Sequence[Frame], sizes: Sequence[int]) -> torch.Tensor:
        """`contents`: the frames' uint8 HxWx3 contents back to back, on the model's device."""
        size = self.spec.input_size
        batch = torch.full((len(frames), 3, size, size), float(self.spec.pad_value), device=self.device)
        offset = 0
        for i, (frame, length) in enumerate(zip(frames, sizes)):
            h = frame.header
            content = contents[offset:offset + length].view(h.height, h.width, 3).permute(2, 0, 1)
            batch[i, :, h.pad_top:h.pad_top + h.height, h.pad_left:h.pad_left + h.width] = \
                content.flip(0) if self.bgr else content
            offset += length
        return batch.mul_(self.gain).add_(self.bias)


def fits_input(frame: Frame, input_size: int) -> bool:
    """The frame's content lies inside the model's square input."""
    h = frame.header
    return h.pad_left + h.width <= input_size and h.pad_top + h.height <= input_size
