"""Where a batch runs: staged on the host by the stage thread, run by the device thread.

`stage()` copies the frames' contents into a staging slot (pinned on CUDA, and
sent on with one non-blocking copy on a side stream) and their thresholds and
geometry into one small array. `run()` builds the padded, normalised canvas,
runs the model and post-processes on the device, then brings the detections
back to the host as one array. Each batch in flight (being staged, waiting,
on the device) has a slot of its own, and a slot is reused only once the
device is done with its batch, so no batch ever reads another's pixels.

A batch whose run raises is retried one frame at a time from the canvas
already on the device, so one poison frame fails alone. An error that means
the device itself is gone (a CUDA error other than running out of memory)
raises `DeviceLost`: the worker gives its frames back and exits for its
supervisor to restart it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from contract.frames import MAPPING_FIELDS, Frame
from contract.settings.models import ModelSpec
from gpu_worker.model import BatchAssembler, LoadedModel
from gpu_worker.postprocess import Geometry, Thresholds, postprocess_rows
from gpu_worker.simulated import SimulatedDevice
from gpu_worker.staging import (
    DETECTION_COLUMNS,
    PARAM_COLUMNS,
    SLOTS,
    Device,
    DeviceOutput,
    HostStaging,
    Staged,
    StagingSlots,
    warm_up_frames,
)


class DeviceLost(RuntimeError):
    """The device can run nothing more (illegal address, device-side assert, a lost GPU)."""


def is_fatal(exc: BaseException) -> bool:
    """A CUDA error that poisons the context; running out of memory is not one."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    return isinstance(exc, torch.AcceleratorError) or (isinstance(exc, RuntimeError) and "CUDA error" in str(exc))


class TorchDevice:
    """The model on `cpu` or `cuda`: canvas, forward and post-processing where the model lives."""

    simulated = False

    def __init__(self, model: LoadedModel, max_batch: int, max_candidates: int, slots: int = SLOTS) -> None:
        self.model = model
        self.spec = model.spec
        self.device = model.device
        self.name = str(model.device)
        self.max_candidates = max_candidates
        self.host = HostStaging(model.spec, StagingSlots(slots, max_batch, model.spec.input_size, model.device))
        self.assemble = BatchAssembler(model.spec, model.device, model.dtype)
        cuda = self.device.type == "cuda"
        self.identity = f"gpu-{torch.cuda.get_device_properties(self.device).uuid}" if cuda else "cpu"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.compute_stream = torch.cuda.Stream(self.device) if cuda else None
        self._threads = threading.local()

    def describe(self) -> dict[str, Any]:
        return self.model.describe()

    def utilisation(self) -> float | None:
        """The driver's GPU utilisation (0-1), by the device torch uses (CUDA_VISIBLE_DEVICES mapped)."""
        if self.device.type != "cuda":
            return None
        try:
            return torch.cuda.utilization(self.device) / 100.0
        except Exception:  # no pynvml, no driver support: the figure is optional
            return None

    def _bind_thread(self) -> None:
        """Each thread that touches the GPU makes it current, so none creates a context on GPU 0."""
        if self.device.type == "cuda" and not getattr(self._threads, "bound", False):
            torch.cuda.set_device(self.device)
            self._threads.bound = True

    # --- the stage thread --------------------------------------------------
    def stage(self, frames: Sequence[Frame]) -> Staged:
        self._bind_thread()
        staged = self.host.fill(frames)
        if self.copy_stream is not None and frames:
            slot, total = staged.slot, sum(staged.sizes)
            with torch.cuda.stream(self.copy_stream):
                slot.device_contents[:total].copy_(slot.host[:total], non_blocking=True)
                slot.device_params[: len(frames)].copy_(slot.params[: len(frames)], non_blocking=True)
                staged.ready = torch.cuda.Event(blocking=True)
                staged.ready.record(self.copy_stream)
        return staged

    # --- the device thread -------------------------------------------------
    def run(self, staged: Staged) -> DeviceOutput:
        self._bind_thread()
        try:
            with torch.inference_mode(), self._on_compute_stream():
                if staged.ready is not None and self.compute_stream is not None:
                    self.compute_stream.wait_event(staged.ready)
                return self._run_batch(staged)
        finally:
            self._quiesce()  # nothing queued may still read this slot when the next batch fills it
            self.host.release(staged)

    def discard(self, staged: Staged) -> None:
        self.host.release(staged)

    def warm_up(self, max_batch: int) -> Iterator[list[Frame]]:
        """Every batch size twice: cuDNN's autotuning, TorchScript's profiling runs and lazy
        loading happen here, and every staging slot is touched; yields each batch's frames."""
        for size in [*range(1, max_batch + 1)] * 2:
            frames = warm_up_frames(self.spec, size)
            self.run(self.stage(frames))
            yield frames

    def _quiesce(self) -> None:
        if self.compute_stream is None:
            return
        try:
            done = torch.cuda.Event(blocking=True)
            done.record(self.compute_stream)
            done.synchronize()
        except Exception:  # a lost device: the worker is leaving, the slot will not be filled again
            pass

    def _on_compute_stream(self) -> Any:
        return torch.cuda.stream(self.compute_stream) if self.compute_stream is not None else nullcontext()

    def _run_batch(self, staged: Staged) -> DeviceOutput:
        started = time.perf_counter()
        marks = _Marks(self.compute_stream)
        canvas = None
        try:
            canvas = self.assemble(staged.slot.device_contents, staged.frames, staged.sizes)
            output = self.model.module(canvas)
            marks.forward_done()
            rows = self._postprocess(output, staged.slot.device_params[: len(staged)])
            marks.postprocess_done()
            infer_s, postprocess_s = marks.seconds()  # waits for the device: its errors surface here
        except Exception as exc:
            if is_fatal(exc):
                raise DeviceLost(str(exc)) from exc
            if len(staged) == 1:
                return self._failed_alone(staged, exc, started)
            return self._frame_by_frame(staged, canvas, started)
        return DeviceOutput(rows, infer_s + postprocess_s, infer_s * 1000.0, postprocess_s * 1000.0)

    def _postprocess(self, output: torch.Tensor, params: torch.Tensor) -> np.ndarray:
        return postprocess_rows(
            output, self.spec.layout, thresholds_of(params), geometry_of(params), self.max_candidates
        )

    def _frame_by_frame(self, staged: Staged, canvas: torch.Tensor | None, started: float) -> DeviceOutput:
        """After a failed batch: each frame alone, from the canvas already on the device when there is one."""
        rows, errors = [], {}
        offsets = np.cumsum([0, *staged.sizes])
        for i, frame in enumerate(staged.frames):
            try:
                if canvas is not None:
                    one = canvas[i : i + 1]
                else:
                    contents = staged.slot.device_contents[int(offsets[i]) : int(offsets[i + 1])]
                    one = self.assemble(contents, [frame], [staged.sizes[i]])
                found = self._postprocess(self.model.module(one), staged.slot.device_params[i : i + 1])
                found[:, 0] = i
                rows.append(found)
            except Exception as exc:
                if is_fatal(exc):
                    raise DeviceLost(str(exc)) from exc
                errors[i] = inference_error(exc)
        elapsed = time.perf_counter() - started
        detections = np.concatenate(rows) if rows else np.empty((0, len(DETECTION_COLUMNS)))
        return DeviceOutput(detections, elapsed, elapsed * 1000.0, 0.0, errors)

    def _failed_alone(self, staged: Staged, exc: Exception, started: float) -> DeviceOutput:
        elapsed = time.perf_counter() - started
        return DeviceOutput(
            np.empty((0, len(DETECTION_COLUMNS))), elapsed, elapsed * 1000.0, 0.0, {0: inference_error(exc)}
        )


class _Marks:
    """Where a batch's device time went: CUDA events on the compute stream (device time, not the
    host's view of it), or the wall clock on the CPU, where host and device are one."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.times = [time.perf_counter()]
        self.events = [self._event()] if stream is not None else []

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(self.stream)
        return event

    def forward_done(self) -> None:
        self._mark()

    def postprocess_done(self) -> None:
        self._mark()

    def _mark(self) -> None:
        if self.stream is not None:
            self.events.append(self._event())
        else:
            self.times.append(time.perf_counter())

    def seconds(self) -> tuple[float, float]:
        """(canvas + forward, post-processing), once both are done; a blocking wait, never a spin."""
        if self.stream is None:
            start, forward, post = self.times
            return forward - start, post - forward
        start, forward, post = self.events
        post.synchronize()
        return start.elapsed_time(forward) / 1000.0, forward.elapsed_time(post) / 1000.0


def inference_error(exc: BaseException) -> dict[str, str]:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return {"code": "inference_error", "message": (lines[-1] if lines else type(exc).__name__)[:500]}


def thresholds_of(params: torch.Tensor) -> Thresholds:
    columns = PARAM_COLUMNS.index
    return Thresholds(
        conf=params[:, columns("conf")].float(),
        iou=params[:, columns("iou")].float(),
        max_det=params[:, columns("max_det")].long(),
    )


def geometry_of(params: torch.Tensor) -> Geometry:
    return Geometry(**{name: params[:, PARAM_COLUMNS.index(name)] for name in MAPPING_FIELDS})


def open_device(
    spec: ModelSpec, requested: str, max_batch: int, max_candidates: int, sim_profile_ms: Mapping[int, float]
) -> Device:
    """`sim` gives the simulated accelerator (the model's own profile when its spec has one: models differ in
    cost); anything else loads the model on a real device (raising ModelLoadError when it cannot be served)."""
    if requested == "sim":
        return SimulatedDevice(spec, spec.sim_latency_ms or sim_profile_ms, max_batch)
    from gpu_worker.model import choose_device, load_model

    return TorchDevice(load_model(spec, choose_device(requested), max_batch), max_batch, max_candidates)
