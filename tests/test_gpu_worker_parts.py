"""GPU-worker parts: model loading, batch assembly, the frame list in real Redis."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import redis
import torch

from contract.frames import FrameHeader, pack_frame, unpack_frame
from contract.frames.frame_source import RedisFrameSource
from contract.redis.keys import Keys
from contract.settings.models import ModelSpec
from gpu_worker.model import BatchAssembler, ModelLoadError, load_model
from tests.support import REPO_ROOT, build_content_box_model

CPU = torch.device("cpu")

M = "m:1"  # the model key these frame lists belong to


def spec(**overrides) -> ModelSpec:
    values = dict(name="m", version="1", labels=("a", "b", "c"), input_size=64)
    return ModelSpec(**{**values, **overrides})


def test_builtin_model_emits_the_yolov8_layout():
    loaded = load_model(spec(input_size=128), CPU)
    with torch.inference_mode():
        output = loaded.module(torch.zeros(2, 3, 128, 128))
    assert output.shape == (2, 4 + 3, 16 * 16 + 8 * 8 + 4 * 4)
    assert loaded.describe()["weights"] == "random"


def test_missing_model_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(spec(format="torchscript", path=str(tmp_path / "none.pt")), CPU)


def test_labels_that_do_not_match_the_output_are_refused(tmp_path):
    path = tmp_path / "m.pt"
    build_content_box_model(num_classes=2).save(str(path))
    with pytest.raises(ModelLoadError, match="expects 7 values per box, the model gives 6"):
        load_model(spec(format="torchscript", path=str(path)), CPU)


def test_yolov5_export_loads_with_its_layout(tmp_path):
    path = tmp_path / "m5.pt"
    build_content_box_model(num_classes=3, layout="yolov5").save(str(path))
    assert load_model(spec(format="torchscript", path=str(path), layout="yolov5"), CPU).spec.layout == "yolov5"


def test_gpu_worker_exits_with_a_clear_message_when_its_model_cannot_load(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{name: x, version: '1', format: torchscript, path: {tmp_path}/no.pt, labels: [a]}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpu_worker", "--config", str(config), "--device", "cpu"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "model file not found" in result.stderr


def make_frame(
    job_id: str, width: int, height: int, pad_left: int, pad_top: int, value: int = 200, options: dict | None = None
):
    header = FrameHeader(
        job_id=job_id,
        width=width,
        height=height,
        pad_left=pad_left,
        pad_top=pad_top,
        scale_x=1.0,
        scale_y=1.0,
        orig_width=width,
        orig_height=height,
        deadline_at=1e12,
        options=options or {},
    )
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = value, value // 2, 0
    return pack_frame(header, pixels.tobytes())


def assemble(model_spec: ModelSpec, frames) -> torch.Tensor:
    contents = torch.cat([torch.frombuffer(bytearray(frame.pixels), dtype=torch.uint8) for frame in frames])
    return BatchAssembler(model_spec, CPU)(contents, frames, [len(frame.pixels) for frame in frames])


def test_batch_assembly_pads_and_normalises_on_the_device():
    frames = [unpack_frame(make_frame("a", 8, 4, 0, 2)), unpack_frame(make_frame("b", 2, 8, 3, 0))]
    batch = assemble(spec(input_size=8, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)), frames)
    assert batch.shape == (2, 3, 8, 8)
    pad = (114 / 255 - 0.5) / 0.5
    assert batch[0, 0, 0, 0].item() == pytest.approx(pad)
    assert batch[0, 0, 2, 0].item() == pytest.approx((200 / 255 - 0.5) / 0.5)
    assert batch[0, 1, 2, 0].item() == pytest.approx((100 / 255 - 0.5) / 0.5)
    assert batch[1, 0, 4, 3].item() == pytest.approx((200 / 255 - 0.5) / 0.5)
    assert batch[1, 0, 4, 5].item() == pytest.approx(pad)


def test_bgr_models_get_channels_swapped():
    frames = [unpack_frame(make_frame("a", 8, 8, 0, 0))]
    batch = assemble(spec(input_size=8, channel_order="bgr"), frames)
    assert batch[0, 2, 0, 0].item() == pytest.approx(200 / 255)
    assert batch[0, 0, 0, 0].item() == 0


def test_frame_source_is_fifo_and_keeps_frames_until_acked(redis_client):
    keys = Keys("t")
    for i in range(5):
        redis_client.lpush(keys.frames(M), f"f{i}")
    source = RedisFrameSource(redis_client, keys, "w1", M)
    assert source.pop_blocking(0.1) == b"f0"
    assert source.pop_available(3) == [b"f1", b"f2", b"f3"]
    assert redis_client.llen(source.processing_key) == 4
    source.ack(4)
    assert redis_client.llen(source.processing_key) == 0
    assert source.pop_available(8) == [b"f4"]
    assert source.pop_available(8) == []
    assert source.pop_blocking(0.1) is None


def test_ack_drops_the_oldest_frames_in_hand(redis_client):
    keys = Keys("t")
    redis_client.lpush(keys.frames(M), "a", "b", "c")
    source = RedisFrameSource(redis_client, keys, "w1", M)
    source.pop_available(2)
    source.pop_available(1)
    source.ack(2)  # the first batch, answered first
    assert redis_client.lrange(keys.processing("w1", M), 0, -1) == [b"c"]


def test_frames_of_any_size_come_back_whole_and_the_reader_recovers_from_errors(redis_client):
    keys = Keys("t")
    frames = [bytes([i]) * size for i, size in enumerate((0, 1, 255, 256, 257, 70_000, 300_000))]
    redis_client.lpush(keys.frames(M), *frames)
    source = RedisFrameSource(redis_client, keys, "w1", M)
    assert [bytes(f) for f in source.pop_available(4) + source.pop_available(8)] == frames
    redis_client.set(keys.frames(M), "not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        source.pop_available(2)
    redis_client.delete(keys.frames(M))
    redis_client.lpush(keys.frames(M), b"\r\n$5\r\n")
    assert source.pop_available(2) == [b"\r\n$5\r\n"]  # the connection was dropped and opened again


def test_requeue_of_a_dead_workers_frames_counts_an_attempt_and_keeps_order(redis_client):
    from contract.frames.frame_source import requeue_frames_of

    keys = Keys("t")
    frames = [make_frame(f"job{i}", 2, 2, 0, 0) for i in range(3)]
    for i in range(3):
        redis_client.hset(keys.job(f"job{i}"), "status", "running")
    redis_client.lpush(keys.frames(M), *frames)
    source = RedisFrameSource(redis_client, keys, "dead", M)
    source.pop_available(3)
    redis_client.zadd(keys.gpu_workers, {"dead": 1.0})
    redis_client.set(keys.heartbeat("dead"), "{}")
    assert requeue_frames_of(redis_client, keys, "dead", [M], only_if_dead=True) == -1  # still alive: untouched
    redis_client.delete(keys.heartbeat("dead"))
    assert requeue_frames_of(redis_client, keys, "dead", [M], only_if_dead=True) == 3
    assert requeue_frames_of(redis_client, keys, "dead", [M], only_if_dead=True) == 0  # a second reaper finds nothing
    assert RedisFrameSource(redis_client, keys, "live", M).pop_available(3) == frames
    assert [redis_client.hget(keys.job(f"job{i}"), "attempts") for i in range(3)] == [b"1"] * 3
    assert redis_client.zscore(keys.gpu_workers, "dead") is None
