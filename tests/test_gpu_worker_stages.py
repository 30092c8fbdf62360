"""The GPU worker's overlapped stages: hand-offs, the device's retry frame by frame, a lost
device, a batch that cannot be triaged. The worker runs in this process against a real Redis,
on a simulated device that answers at once (or on the CPU with a model that misbehaves)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
import yaml

from bench.meters.feed import push_frames
from contract.frames import unpack_frame
from contract.redis.keys import Keys
from contract.settings.config import load_settings
from contract.settings.models import ModelSpec
from gpu_worker.devices import DeviceLost, TorchDevice, is_fatal
from gpu_worker.model import LoadedModel
from gpu_worker.simulated import SimulatedDevice
from gpu_worker.stage_queue import StageQueue
from gpu_worker.worker import EXIT_DEVICE_LOST, GpuWorker
from tests.support import wait_until
from tests.test_gpu_worker_parts import make_frame

SPEC = {"name": "m", "version": "1", "labels": ["a", "b"], "input_size": 64}
MODEL_KEY = "m:1"
GEOMETRY = {
    "width": 64,
    "height": 48,
    "pad_left": 0,
    "pad_top": 8,
    "scale_x": 1.0,
    "scale_y": 1.0,
    "orig_width": 64,
    "orig_height": 48,
}
CONTENT = (GEOMETRY, bytes(64 * 48 * 3))


# --- hand-offs -------------------------------------------------------------
def test_a_handoff_holds_one_item_and_its_close_lets_the_consumer_finish_what_waits():
    queue: StageQueue[int] = StageQueue(1)
    queue.put(1)
    assert queue.waiting()
    third_put = threading.Thread(target=lambda: (queue.put(2), queue.close()))
    third_put.start()
    third_put.join(0.2)
    assert third_put.is_alive()  # no room: the producer waits, memory stays bounded
    assert list(queue) == [1, 2]  # then the consumer drains it and stops at the close
    third_put.join(5)
    assert not queue.waiting()


# --- the device --------------------------------------------------------------
class RefusesDarkFrames(torch.nn.Module):
    """One box per image (yolov8 layout, 2 classes); a batch holding a black frame raises."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.flatten(1).amax(dim=1) < 0.01).any()):
            raise RuntimeError("a dark frame poisons the whole batch\nValueError: dark frame")
        box = torch.tensor([32.0, 32.0, 16.0, 16.0, 0.9, 0.1]).view(1, 6, 1)
        return box.expand(x.shape[0], -1, -1) + x.mean() * 0


def test_a_failed_batch_is_retried_frame_by_frame_from_its_canvas_so_one_bad_frame_fails_alone():
    spec = ModelSpec(name="m", version="1", labels=("a", "b"), input_size=16, pad_value=0)
    device = TorchDevice(LoadedModel(spec, RefusesDarkFrames(), torch.device("cpu")), max_batch=4, max_candidates=10)
    frames = [unpack_frame(make_frame(f"j{i}", 16, 16, 0, 0, value=0 if i == 2 else 200)) for i in range(4)]
    output = device.run(device.stage(frames))
    assert output.errors == {2: {"code": "inference_error", "message": "ValueError: dark frame"}}
    assert output.detections[:, 0].tolist() == [0, 1, 3]  # the others answered, in batch order
    assert device.run(device.stage(frames[:2])).errors == {}  # and the device goes on serving


@pytest.mark.parametrize(
    "error,fatal",
    [
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("shape '[8, 3]' is invalid for input of size 5"), False),
    ],
)
def test_only_errors_that_poison_the_device_are_fatal(error, fatal):
    assert is_fatal(error) is fatal


# --- the worker, in this process -----------------------------------------------
def worker_on(
    client: redis.Redis, tmp_path: Path, device_of: Callable[[ModelSpec], Any] | None = None, max_batch: int = 2
) -> GpuWorker:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "namespace": "stages",
                "model": SPEC,
                "batching": {"max_batch_size": max_batch, "window_ms": 1},
                "gpu_worker": {"heartbeat_ttl_s": 5},
            }
        )
    )
    settings = load_settings(config)
    device = (device_of or instant_device)(settings.model)
    return GpuWorker(settings, client, [device], "stages-gpu")


def instant_device(spec: ModelSpec) -> SimulatedDevice:
    return SimulatedDevice(spec, {1: 0.0}, max_batch=8)


def statuses(client: redis.Redis, keys: Keys, ids: list[str]) -> list[str]:
    return [(client.hget(keys.job(job_id), "status") or b"missing").decode() for job_id in ids]


def run_until(worker: GpuWorker, done: Callable[[], bool]) -> int:
    """worker.run() here (it owns the signal handlers); a watcher stops it once `done()`."""

    def watch() -> None:
        try:
            wait_until(done, 60, what="the worker's work")
        finally:
            worker.stopping.set()

    threading.Thread(target=watch, daemon=True).start()
    return worker.run()


def test_a_batch_whose_triage_loses_redis_goes_back_in_its_turn_and_nothing_is_lost(
    redis_client, tmp_path, monkeypatch
):
    keys = Keys("stages")
    ids, _ = push_frames(redis_client, keys, MODEL_KEY, [CONTENT], 9)
    worker = worker_on(redis_client, tmp_path)
    real = worker.store.advance_many
    calls = []

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise redis.ConnectionError("Redis went away for a moment")
        return real(*args, **kwargs)

    monkeypatch.setattr(worker.store, "advance_many", fails_once)
    code = run_until(worker, lambda: statuses(redis_client, keys, ids) == ["succeeded"] * 9)
    assert code == 0 and len(calls) > 5  # five batches, and the one that failed
    assert redis_client.llen(keys.processing("stages-gpu", MODEL_KEY)) == 0
    assert redis_client.llen(keys.frames(MODEL_KEY)) == 0
    batches = [yaml.safe_load(redis_client.hget(keys.job(job_id), "batch")) for job_id in ids]
    assert all(batch["worker"] == "stages-gpu" for batch in batches)
    assert redis_client.hget(keys.job(ids[2]), "attempts") is None  # given back is not an attempt


class LosesTheDevice:
    """A simulated device whose second batch meets a fatal error."""

    def __init__(self, spec: ModelSpec) -> None:
        self.inner = instant_device(spec)
        self.runs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run(self, staged: Any) -> Any:
        self.runs += 1
        if self.runs == 2:
            self.inner.discard(staged)
            raise DeviceLost("CUDA error: an illegal memory access was encountered")
        return self.inner.run(staged)


def test_a_lost_device_writes_what_it_finished_gives_back_what_it_held_and_exits_non_zero(redis_client, tmp_path):
    keys = Keys("stages")
    ids, _ = push_frames(redis_client, keys, MODEL_KEY, [CONTENT], 6)
    worker = worker_on(redis_client, tmp_path, LosesTheDevice)
    assert worker.run() == EXIT_DEVICE_LOST
    assert statuses(redis_client, keys, ids[:2]) == ["succeeded"] * 2  # the first batch
    held = [job_id for job_id in ids[2:] if redis_client.hget(keys.job(job_id), "attempts") == b"1"]
    assert held and statuses(redis_client, keys, held) == ["running"] * len(held)  # back in line, counted
    assert redis_client.llen(keys.processing("stages-gpu", MODEL_KEY)) == 0
    assert redis_client.llen(keys.frames(MODEL_KEY)) == 4
    assert not redis_client.exists(keys.heartbeat("stages-gpu"))


def test_warm_up_runs_every_batch_size_through_the_device(redis_client, tmp_path):
    spec = ModelSpec(name="m", version="1", labels=("a", "b"), input_size=16)
    device = TorchDevice(LoadedModel(spec, RefusesDarkFrames(), torch.device("cpu")), max_batch=3, max_candidates=10)
    sizes = [len(frames) for frames in device.warm_up(3)]
    assert sizes == [1, 2, 3, 1, 2, 3]
    assert np.frombuffer(device.host.slots.acquire().host.numpy(), np.uint8).any()  # the slots were touched


class BreaksOnce(LosesTheDevice):
    """A device stage whose first batch meets a defect (not a lost device)."""

    def run(self, staged: Any) -> Any:
        self.runs += 1
        if self.runs == 1:
            self.inner.discard(staged)
            raise ValueError("a defect in the device stage")
        return self.inner.run(staged)


def test_a_defect_in_the_device_stage_fails_its_batch_and_the_worker_serves_on(redis_client, tmp_path):
    keys = Keys("stages")
    ids, _ = push_frames(redis_client, keys, MODEL_KEY, [CONTENT], 6)
    worker = worker_on(redis_client, tmp_path, BreaksOnce)
    done = ["failed"] * 2 + ["succeeded"] * 4
    assert run_until(worker, lambda: statuses(redis_client, keys, ids) == done) == 0
    error = yaml.safe_load(redis_client.hget(keys.job(ids[0]), "error"))
    assert error == {"code": "inference_error", "message": "a defect in the device stage"}
    assert redis_client.llen(keys.processing("stages-gpu", MODEL_KEY)) == 0


def test_a_damaged_or_oversized_frame_fails_its_own_job_as_bad_frame_and_the_rest_go_on():
    from types import SimpleNamespace

    from gpu_worker.batcher import Batch
    from gpu_worker.feeder import Feeder
    from tests.test_gpu_worker_parts import make_frame

    good = make_frame("good", 48, 32, 8, 16)
    truncated = make_frame("truncated", 48, 32, 8, 16)[:-10]  # its header promises more pixels
    too_wide = make_frame("too-wide", 80, 32, 0, 16)  # does not fit a 64 input
    unreadable = b"not a frame at all"  # no job id to fail: logged, dropped
    batch = Batch(
        items=[memoryview(f) for f in (good, truncated, too_wide, unreadable)],
        opened_at=0.0,
        closed_at=0.0,
        closed_by="full",
        popped_at=[1.0, 2.0, 3.0, 4.0],
    )
    frames, refused, _ = Feeder._unpack(SimpleNamespace(input_size=64), batch)  # type: ignore[arg-type]
    assert [frame.header.job_id for frame, _ in frames] == ["good"] and frames[0][1] == 1.0
    assert [(job_id, status, fields["error"]["code"]) for job_id, status, fields in refused] == [
        ("truncated", "failed", "bad_frame"),
        ("too-wide", "failed", "bad_frame"),
    ]
    assert "does not fit the model's 64x64 input" in refused[1][2]["error"]["message"]
