"""Loading the detector a spec names, and feeding it a batch of frames."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contract.frames import CHANNELS, Frame
from contract.settings.model_files import describe_kind, identify
from contract.settings.models import ModelSpec
from gpu_worker import tiny_yolo


class ModelLoadError(RuntimeError):
    """A model that cannot be served as its spec says."""


PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    spec: ModelSpec
    module: torch.nn.Module
    device: torch.device
    dtype: torch.dtype = torch.float32  # what the model computes in: its input canvas is built in it
    output: str = "tensor"  # or "element 0 of a tuple" (YOLOv5's own export)

    def describe(self) -> dict[str, Any]:
        return {
            **self.spec.describe(),
            "device": str(self.device),
            "simulated": False,
            "format": self.spec.format,
            "precision": next(name for name, dtype in PRECISIONS.items() if dtype == self.dtype),
            "accelerate": self.spec.accelerate,
            "output": self.output,
        }


class FirstOutput(torch.nn.Module):
    """A model returning a tuple whose element 0 is the prediction: YOLOv5's own TorchScript export gives
    `(pred,)`, or `(pred, [feature maps])` when traced without its export flag; YOLOv5's loader takes
    element 0, and so does this."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.inner(batch)[0]


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


def load_model(spec: ModelSpec, device: torch.device, max_batch: int = 8) -> LoadedModel:
    """The spec's model on `device`, in its precision, checked at batch 1 and at the largest batch."""
    if spec.format == "builtin":
        module = _load_builtin(spec).to(device).eval()
    elif spec.format == "export":
        module = _load_exported(spec, device)
    else:
        module = _load_torchscript(spec, device).eval()
    dtype = PRECISIONS.get(spec.precision) or _own_dtype(module)
    if spec.precision != "auto":
        module = module.to(dtype)
    if spec.channels_last:
        module = module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # not in the stubs
    if spec.freeze:
        module = _frozen(module)
    if device.type == "cuda":  # cuDNN autotunes each shape on its first run: the load checks, warm-up, captures
        torch.backends.cudnn.benchmark = True
    loaded = LoadedModel(spec=spec, module=module, device=device, dtype=dtype)
    if _prediction_first_in_tuple(_probe(loaded, 1)):
        loaded.module, loaded.output = FirstOutput(module), "element 0 of a tuple"
    loaded.module = _accelerated(loaded, max_batch)
    for batch in sorted({1, max_batch}):
        _check_output(loaded, batch)
    return loaded


def _accelerated(loaded: LoadedModel, max_batch: int) -> torch.nn.Module:
    """The spec's `accelerate`, applied once the module is final (precision, layout, freezing, output)."""
    spec, module = loaded.spec, loaded.module
    if spec.accelerate == "compile":
        try:  # compiled by the load checks that follow: batch 1 (specialised) and the largest (dynamic)
            return torch.compile(module, dynamic=True)  # type: ignore[return-value]  # a callable wrapper
        except Exception as exc:
            raise ModelLoadError(f"accelerate: compile failed: {last_line(exc)}") from exc
    if spec.accelerate == "cuda_graphs":
        if loaded.device.type != "cuda":
            raise ModelLoadError(f"accelerate: cuda_graphs needs a CUDA device, not {loaded.device}")
        try:
            return CudaGraphs(module, lambda batch: _blank(loaded, batch), max_batch)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"accelerate: cuda_graphs: the model cannot be captured: {last_line(exc)}") from exc
    return module


class CudaGraphs(torch.nn.Module):
    """The model as one CUDA graph per batch size, all captured at load: a batch copies its canvas into
    its size's static input and replays the whole forward with one launch, instead of Python launching
    each kernel. The answer is the graph's static output: read it before the next batch of that size
    runs (the device thread does - post-processing is queued on the same stream first).

    Captured largest first into one memory pool, so the smaller graphs reuse the largest one's memory."""

    def __init__(self, inner: torch.nn.Module, blank: Callable[[int], torch.Tensor], max_batch: int) -> None:
        super().__init__()
        self.inner = inner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        device = blank(1).device
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        with torch.inference_mode():
            for batch in range(max_batch, 0, -1):
                static_input = blank(batch)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # eager runs first: autotuning, lazy loading, TorchScript profiling
                    for _ in range(3):
                        inner(static_input)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    static_output = inner(static_input)
                if not isinstance(static_output, torch.Tensor):
                    raise ModelLoadError(f"model output must be one tensor, got {_shape_of(static_output)}")
                self.graphs[batch] = (graph, static_input, static_output)
        torch.cuda.synchronize(device)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        captured = self.graphs.get(batch.shape[0])
        if captured is None:
            raise ValueError(f"no CUDA graph for a batch of {batch.shape[0]} (captured: 1-{max(self.graphs)})")
        graph, static_input, static_output = captured
        static_input.copy_(batch)
        graph.replay()
        return static_output


def _blank(loaded: LoadedModel, batch: int) -> torch.Tensor:
    """A blank canvas as the model is fed: its device, dtype and memory layout."""
    size = loaded.spec.input_size
    blank = torch.zeros(batch, CHANNELS, size, size, device=loaded.device, dtype=loaded.dtype)
    return blank.contiguous(memory_format=torch.channels_last) if loaded.spec.channels_last else blank


def _frozen(module: torch.nn.Module) -> torch.nn.Module:
    """Weights inlined as constants, then folded and fused for inference (conv + batch norm, ...)."""
    try:
        return torch.jit.optimize_for_inference(torch.jit.freeze(module))
    except Exception as exc:
        raise ModelLoadError(f"cannot freeze the TorchScript model: {last_line(exc)}") from exc


def _own_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point weights (a half-precision export stays half), else float32."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype if tensor.dtype in PRECISIONS.values() else torch.float32
    return torch.float32


def _load_builtin(spec: ModelSpec) -> torch.nn.Module:
    if spec.builtin != "tiny_yolo":
        raise ModelLoadError(f"unknown builtin model {spec.builtin!r}")
    if spec.layout != "yolov8":
        raise ModelLoadError("the builtin tiny_yolo emits the yolov8 layout")
    return tiny_yolo.build_random(len(spec.labels))


def _model_file(spec: ModelSpec) -> Path:
    """The spec's file, when it is the kind its format says (an ONNX file or an Ultralytics .pt is named)."""
    path = Path(spec.path or "")
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    kind = identify(path)
    if kind != spec.format:
        raise ModelLoadError(f"{path} is {describe_kind(kind)}; the spec says format: {spec.format}")
    return path


def _load_torchscript(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    path = _model_file(spec)
    try:
        return torch.jit.load(str(path), map_location=device)
    except Exception as exc:
        raise ModelLoadError(f"cannot load TorchScript model {path}: {last_line(exc)}") from exc


def _load_exported(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    """A torch.export program (.pt2), exported with a dynamic batch dimension to serve batches.
    Moved with move_to_device_pass, not .to(): a program exported on the CPU has the CPU written into
    its graph too (an arange, a new tensor), which .to() would leave behind."""
    from torch.export.passes import move_to_device_pass

    path = _model_file(spec)
    try:
        program = torch.export.load(str(path))
        if device.type != "cpu":
            program = move_to_device_pass(program, device)
        return program.module()
    except Exception as exc:
        raise ModelLoadError(f"cannot load exported program {path}: {last_line(exc)}") from exc


def _probe(loaded: LoadedModel, batch: int) -> Any:
    """The model's output for a blank batch; a ModelLoadError saying why when it fails."""
    size = loaded.spec.input_size
    probe = _blank(loaded, batch)
    try:
        with torch.inference_mode():
            return loaded.module(probe)
    except Exception as exc:
        reason = last_line(exc)
        hint = " (exported with a static batch size, or for another input size?)" if _about_shapes(reason) else ""
        raise ModelLoadError(f"the model fails on a batch of {batch} at {size}x{size}{hint}: {reason}") from exc


def _prediction_first_in_tuple(output: Any) -> bool:
    return (
        isinstance(output, (tuple, list))
        and len(output) > 0
        and isinstance(output[0], torch.Tensor)
        and output[0].dim() == 3
    )


def _check_output(loaded: LoadedModel, batch: int) -> None:
    """One dry run: the output must match the layout, the labels and the batch."""
    output = _probe(loaded, batch)
    if not isinstance(output, torch.Tensor) or output.dim() != 3 or output.shape[0] != batch:
        raise ModelLoadError(f"model output must be one 3-D tensor, got {_shape_of(output)}")
    classes = len(loaded.spec.labels)
    expected = 4 + classes if loaded.spec.layout == "yolov8" else 5 + classes
    actual = output.shape[1] if loaded.spec.layout == "yolov8" else output.shape[2]
    if actual != expected:
        raise ModelLoadError(
            f"layout {loaded.spec.layout} with {classes} labels expects {expected} values per box, "
            f"the model gives {actual} (output shape {tuple(output.shape)})"
        )


def last_line(exc: BaseException) -> str:
    """An exception's last non-empty line, whole: where torch puts the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _about_shapes(reason: str) -> bool:
    return any(word in reason.lower() for word in ("shape", "size", "dimension", "guard", "expected input"))


def _shape_of(output: Any) -> str:
    return str(tuple(output.shape)) if isinstance(output, torch.Tensor) else type(output).__name__


class BatchAssembler:
    """Frames' contents, already where the model runs -> one normalised [B, CHANNELS, S, S] canvas.

    Padding, conversion to float, channel order and normalisation run there,
    once, for the whole batch: a channels-first canvas in the pad colour, each
    frame's content written into its place (the uint8 -> float conversion
    rides on that copy), then one in-place affine pass, x * scale / std - mean / std.
    """

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.spec = spec
        self.device = device
        self.dtype = dtype
        mean = torch.tensor(spec.mean, device=device).view(1, CHANNELS, 1, 1)
        std = torch.tensor(spec.std, device=device).view(1, CHANNELS, 1, 1)
        self.gain = spec.scale / std
        self.bias = -mean / std
        self.bgr = spec.channel_order == "bgr"
        self.memory_format = torch.channels_last if spec.channels_last else torch.contiguous_format

    def __call__(self, contents: torch.Tensor, frames: Sequence[Frame], sizes: Sequence[int]) -> torch.Tensor:
        """`contents`: the frames' uint8 HxWx3 contents back to back, on the model's device."""
        size = self.spec.input_size
        batch = torch.full((len(frames), CHANNELS, size, size), float(self.spec.pad_value), device=self.device)
        offset = 0
        for i, (frame, length) in enumerate(zip(frames, sizes)):
            h = frame.header
            content = contents[offset : offset + length].view(h.height, h.width, CHANNELS).permute(2, 0, 1)
            batch[i, :, h.pad_top : h.pad_top + h.height, h.pad_left : h.pad_left + h.width] = (
                content.flip(0) if self.bgr else content
            )
            offset += length
        # Normalised in float32, then handed to the model in its own precision.
        return batch.mul_(self.gain).add_(self.bias).to(self.dtype, memory_format=self.memory_format)


def fits_input(frame: Frame, input_size: int) -> bool:
    """The frame's content lies inside the model's square input."""
    h = frame.header
    return h.pad_left + h.width <= input_size and h.pad_top + h.height <= input_size
