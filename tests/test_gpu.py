"""The device stage where it matters most: on CUDA. `pytest -m gpu` (scripts/gpu-smoke runs it).

Every check runs on the CPU too, so the checks themselves are tested on every machine; the CUDA
variants are skipped without a GPU. What they hold the CUDA path to: every model format loads and
runs there, CUDA agrees with the CPU, the overlapped stages give what a serial run gives (run once
under TORCH_CUDA_SANITIZER=1 by the smoke script), memory stays flat, an out-of-memory batch is
answered frame by frame, a fatal CUDA error becomes DeviceLost, and the host syncs per batch are
counted and bounded.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from contract.frames import Frame, unpack_frame
from contract.settings.config import load_model_spec
from contract.settings.models import ModelSpec
from gpu_worker.devices import TorchDevice
from gpu_worker.model import load_model
from gpu_worker.stage_queue import StageQueue
from tests.support import REPO_ROOT, HostReads

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
]
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
SHAPES = REPO_ROOT / "configs" / "models" / "shapes-yolo.yaml"


def shapes_spec(**overrides) -> ModelSpec:
    spec = load_model_spec(str(SHAPES), REPO_ROOT)
    return ModelSpec(**{**spec.__dict__, **overrides})


def scene_frames(count: int, input_size: int = 320, seed: int = 0) -> list[Frame]:
    """Frames of mixed sizes and places with shapes in them, as the CPU stage would push them."""
    from PIL import Image, ImageDraw

    from contract.frames import FrameHeader, pack_frame
    from tasks.decoding.imaging import letterbox

    rng = np.random.default_rng(seed)
    frames = []
    for i in range(count):
        width, height = int(rng.integers(120, 900)), int(rng.integers(120, 900))
        image = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(0, 255, 3)))
        draw = ImageDraw.Draw(image)
        for _ in range(3):
            x, y = int(rng.integers(0, width - 60)), int(rng.integers(0, height - 60))
            size = int(rng.integers(30, 60))
            draw.ellipse((x, y, x + size, y + size), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        boxed = letterbox(image, (width, height), input_size)
        header = FrameHeader(job_id=f"scene{i}", **boxed.placement.fields(), deadline_at=1e12)
        frames.append(unpack_frame(bytearray(pack_frame(header, boxed.pixels))))
    return frames


def device_for(name: str, spec: ModelSpec | None = None, max_batch: int = 8, model=None) -> TorchDevice:
    spec = spec or shapes_spec()
    loaded = model or load_model(spec, torch.device(name), max_batch)
    return TorchDevice(loaded, max_batch=max_batch, max_candidates=1000)


@pytest.mark.parametrize("device", DEVICES)
def test_every_model_format_loads_and_runs_batch_one_and_the_largest(device, tmp_path):
    from tests.test_user_models import CpuConstantsInTheGraph

    dynamic = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(
        CpuConstantsInTheGraph(), (torch.zeros(2, 3, 64, 64),), dynamic_shapes=({0: dynamic},)
    )  # exported on the CPU, devices in its graph
    torch.export.save(program, str(tmp_path / "consts.pt2"))
    specs = [
        shapes_spec(),  # TorchScript
        ModelSpec(name="b", version="1", labels=("a", "b", "c"), input_size=128),  # builtin
        ModelSpec(
            name="e", version="1", format="export", path=str(tmp_path / "consts.pt2"), labels=("a", "b"), input_size=64
        ),
    ]
    for spec in specs:
        loaded = load_model(spec, torch.device(device), max_batch=8)
        size = spec.input_size
        with torch.inference_mode():
            for batch in (1, 8):
                assert loaded.module(torch.zeros(batch, 3, size, size, device=device)).shape[0] == batch


def detections_by_image(rows: np.ndarray, count: int) -> list[np.ndarray]:
    return [rows[rows[:, 0] == i][:, 1:] for i in range(count)]


@pytest.mark.parametrize("channel_order", ["rgb", "bgr"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_cuda_and_cpu_give_the_same_detections(device, batch, channel_order):
    spec = shapes_spec(channel_order=channel_order)
    frames = scene_frames(batch, seed=batch)
    answers = []
    for name in ("cpu", device):
        runner = device_for(name, spec)
        answers.append(detections_by_image(runner.run(runner.stage(frames)).detections, batch))
    for on_cpu, on_cuda in zip(*answers):
        confident_cpu, confident_cuda = on_cpu[on_cpu[:, 4] > 0.5], on_cuda[on_cuda[:, 4] > 0.5]
        assert len(confident_cpu) == len(confident_cuda)
        if len(confident_cpu):
            assert np.allclose(confident_cpu[:, :4], confident_cuda[:, :4], atol=1.0)  # original pixels
            assert np.allclose(confident_cpu[:, 4], confident_cuda[:, 4], atol=2e-3)
            assert (confident_cpu[:, 5] == confident_cuda[:, 5]).all()


def run_overlapped(runner: TorchDevice, batches: list[list[Frame]]) -> list[np.ndarray]:
    """Each batch staged in one thread while the device runs the one before in another, as the worker
    does (three slots in flight): the detections of each."""
    queue: StageQueue = StageQueue(1)

    def stage_all() -> None:
        for frames in batches:
            queue.put(runner.stage(frames))
        queue.close()

    threading.Thread(target=stage_all, daemon=True).start()
    return [runner.run(staged).detections for staged in queue]


@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_stages_give_what_a_serial_run_gives(device):
    """Stage in one thread while the device runs in another, as the worker does (three slots in
    flight); the answers equal a run of the same batches one at a time."""
    batches = [scene_frames(int(size), seed=i) for i, size in enumerate(np.random.default_rng(3).integers(1, 9, 12))]
    runner = device_for(device)
    serial = [runner.run(runner.stage(frames)).detections for frames in batches]
    overlapped = run_overlapped(runner, batches)
    assert len(overlapped) == len(serial)
    for one, other in zip(serial, overlapped):
        assert np.array_equal(one, other)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_device_memory_stays_flat_over_500_batches(device):
    runner = device_for(device)
    frames = scene_frames(8)
    for _ in range(50):
        runner.run(runner.stage(frames))
    torch.cuda.synchronize()
    settled = torch.cuda.memory_allocated(device)
    for _ in range(450):
        runner.run(runner.stage(frames))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(device) <= settled + 1024 * 1024


class RunsOutOfMemoryOnBatches(torch.nn.Module):
    """The shapes model, but a batch of more than one image runs out of memory."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return self.inner(x)


@pytest.mark.parametrize("device", DEVICES)
def test_an_out_of_memory_batch_is_answered_frame_by_frame(device):
    loaded = load_model(shapes_spec(), torch.device(device), 8)
    loaded.module = RunsOutOfMemoryOnBatches(loaded.module)
    runner = device_for(device, model=loaded)
    frames = scene_frames(5)
    reference = device_for(device)
    expected = reference.run(reference.stage(frames)).detections
    output = runner.run(runner.stage(frames))
    assert output.errors == {}
    assert np.allclose(output.detections, expected, atol=1e-3)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_a_fatal_cuda_error_becomes_device_lost(device):
    """A device-side assert poisons the process's CUDA context: so it runs in a process of its own."""
    code = f"""
import torch
from gpu_worker.devices import DeviceLost, TorchDevice
from tests.test_gpu import device_for, scene_frames, load_model, shapes_spec

class OutOfBounds(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0
    def forward(self, x):
        self.calls += 1
        if self.calls > 2:   # after the load checks: index far past the end, on the device
            return x.flatten()[torch.tensor([2 ** 40], device=x.device)].view(1, 1, 1).expand(x.shape[0], 7, 1)
        return self.inner(x)

loaded = load_model(shapes_spec(), torch.device({device!r}), 8)
loaded.module = OutOfBounds(loaded.module)
runner = device_for({device!r}, model=loaded)
try:
    runner.run(runner.stage(scene_frames(2)))
    torch.cuda.synchronize()
except DeviceLost:
    print("device lost")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert "device lost" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("device", DEVICES)
def test_host_syncs_per_batch_are_counted_and_bounded(device, capsys):
    """A batch of 8 reads the device twice (how many candidates, whether NMS has settled) and copies
    its answer back once. On CUDA, sync_debug_mode counts every sync the batch makes, and the two
    blocking event waits (the batch's device time, and its slot's release) are all it may add."""
    import warnings

    runner = device_for(device)
    frames = scene_frames(8)
    runner.run(runner.stage(frames))
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, HostReads() as reads:
            warnings.simplefilter("always")
            output = runner.run(runner.stage(frames))
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    with capsys.disabled():
        print(
            f"\nhost reads in one batch of 8 on {device}: {len(reads)} {reads.names}"
            + (f"; syncs sync_debug_mode saw: {len(syncs)}" if device == "cuda" else "")
        )
    assert len(output.detections) > 0
    assert 1 <= len(reads) <= 2  # at least the candidate count: the counter works
    assert len(syncs) <= 2 + 1 + 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("option", [{"channels_last": True}, {"freeze": True}, {"precision": "bf16"}])
def test_speed_options_keep_the_answers(device, option):
    frames = scene_frames(4, seed=7)
    plain, tuned = device_for(device), device_for(device, shapes_spec(**option))
    expected = detections_by_image(plain.run(plain.stage(frames)).detections, 4)
    found = detections_by_image(tuned.run(tuned.stage(frames)).detections, 4)
    tolerance = 4.0 if option.get("precision") == "bf16" else 0.5  # bf16 keeps 8 bits of mantissa
    for one, other in zip(expected, found):
        one, other = one[one[:, 4] > 0.5], other[other[:, 4] > 0.5]
        assert len(one) == len(other) and np.allclose(one[:, :4], other[:, :4], atol=tolerance)
