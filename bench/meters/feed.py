"""`bench feed`: the GPU worker alone, against the device's limit.

N frames are pushed in advance into a private Redis (made by the real CPU
stage from 640x480 JPEGs, or synthetic content of a given size), then one
`python -m gpu_worker` drains them. The report gives frames/s against what the
device could do (the profile's full batch on `sim`, a timed forward of a full
batch on `cpu`/`cuda`), the mean batch, and the worker's own host time per
batch by stage (wall and CPU), from the stage counters it publishes.

A second drain of the same frames by a bare consumer (the worker's Redis
calls and nothing else) measures the rate at which Redis itself, push and pop,
becomes the limit.
"""

from __future__ import annotations

import io
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import yaml
from PIL import Image

from bench.stack.cpu import cpu_shares, cpu_times
from bench.stack.processes import (
    ManagedProcess,
    RedisServer,
    gpu_worker_argv,
    wait_until,
)
from bench.stack.profiles import parse_profile
from contract.frames import FrameHeader, pack_frame
from contract.jobs.record import QUEUED_GPU
from contract.jobs.timebill import (
    CPU_STARTED_AT,
    DECODE_MS,
    HOST_STAGES,
    PUSHED_AT,
    RECEIVED_AT,
    RESIZE_MS,
    SUBMITTED_AT,
    host_ms_per_batch,
)
from contract.redis.keys import Keys
from contract.settings import REPO_ROOT
from gpu_worker.simulated import profile_latency_s

DEFAULT_SPEC = REPO_ROOT / "configs" / "models" / "shapes-yolo.yaml"
NAMESPACE = "feed"
WORKER_ID = "feed-gpu"


@dataclass
class FeedOptions:
    device: str = "sim"
    profile: str = "fast"  # fast | story | "1:2,8:6,16:10" (ms per batch size)
    frames: int = 1600
    input_size: int = 320
    source: str = "jpeg"  # jpeg: the real CPU stage on generated JPEGs | synthetic
    image_size: tuple[int, int] = (640, 480)
    distinct_images: int = 16
    max_batch: int = 8
    window_ms: float = 12.0
    model: Path = DEFAULT_SPEC
    model_options: dict[str, Any] = field(default_factory=dict)  # over the spec's own: accelerate, precision...
    redis_check: bool = True
    py_spy: Path | None = None  # record the worker with py-spy (collapsed stacks) into this file
    extra_config: dict[str, Any] = field(default_factory=dict)

    def profile_ms(self) -> dict[int, float]:
        return parse_profile(self.profile)


# --- frames ---------------------------------------------------------------
def frame_contents(options: FeedOptions) -> list[tuple[dict[str, Any], bytes]]:
    """(geometry, content pixels) of each distinct image, as the CPU stage would push them."""
    from tasks.decoding.imaging import decode_image, letterbox

    rng = np.random.default_rng(7)
    width, height = options.image_size
    contents = []
    for _ in range(options.distinct_images):
        if options.source == "jpeg":
            data = _jpeg(rng, width, height)
            image, orig_size = decode_image(data, options.input_size, 10**9)
        elif options.source == "synthetic":
            image = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
            orig_size = (width, height)
        else:
            raise SystemExit(f"--source {options.source!r}: expected jpeg or synthetic")
        boxed = letterbox(image, orig_size, options.input_size)
        contents.append((boxed.placement.fields(), boxed.pixels))
    return contents


def _jpeg(rng: np.random.Generator, width: int, height: int) -> bytes:
    """Smooth gradients with grain: decodes like a photo, quickly generated."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width), y * 255 // max(1, height), (x + y) * 127 // (width + height)], -1)
    noisy = base + rng.normal(0, 12, base.shape)
    buffer = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def push_frames(
    client: redis.Redis,
    keys: Keys,
    model_key: str,
    contents: list[tuple[dict[str, Any], bytes]],
    count: int,
    chunk: int = 64,
) -> tuple[list[str], float]:
    """Job records (queued_gpu, as the CPU stage leaves them) and their frames; the push's seconds."""
    ids: list[str] = []
    started = time.perf_counter()
    now = time.time()
    for first in range(0, count, chunk):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(count, first + chunk)):
            job_id = uuid.uuid4().hex
            geometry, pixels = contents[i % len(contents)]
            stamps = {
                RECEIVED_AT: now,
                SUBMITTED_AT: now,
                CPU_STARTED_AT: now,
                DECODE_MS: 0.0,
                RESIZE_MS: 0.0,
                PUSHED_AT: now,
            }
            header = FrameHeader(job_id=job_id, deadline_at=now + 3600, stamps=stamps, **geometry)
            pipe.hset(
                keys.job(job_id),
                mapping={"id": job_id, "status": QUEUED_GPU, "deadline_at": now + 3600, RECEIVED_AT: now},
            )
            pipe.expire(keys.job(job_id), 3600)
            pipe.lpush(keys.frames(model_key), pack_frame(header, pixels))
            ids.append(job_id)
        pipe.execute()
    return ids, time.perf_counter() - started


# --- the device's limit ---------------------------------------------------
def device_limit(options: FeedOptions, counters: dict[str, float], mean_batch: float) -> tuple[float, str]:
    """Frames/s the device alone could do, and how that was found: on `sim` the profile's full
    batch; on a real device its own time per batch as the worker measured it (canvas, forward and
    post-processing), run back to back at the batch size it saw: the share is then how busy the
    worker kept it."""
    if options.device == "sim":
        latency = profile_latency_s(options.profile_ms(), options.max_batch)
        return options.max_batch / latency, f"profile: batch {options.max_batch} in {latency * 1000:.1f} ms"
    per_batch = counters.get("device_seconds_total", 0.0) / max(1.0, counters.get("batches_total", 0.0))
    if per_batch <= 0:
        return float("nan"), "no device time measured"
    return mean_batch / per_batch, f"{options.device}: batch of {mean_batch:.1f} in {per_batch * 1000:.1f} ms"


# --- the run --------------------------------------------------------------
def run_feed(options: FeedOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="feed-"))
    spec_raw = {**yaml.safe_load(options.model.read_text()), "input_size": options.input_size, **options.model_options}
    if spec_raw.get("path"):
        spec_raw["path"] = str((options.model.parent / spec_raw["path"]).resolve())
    contents = frame_contents(options)
    frame_bytes = statistics.mean(len(pixels) for _, pixels in contents)
    server = RedisServer(workdir)
    client = redis.Redis.from_url(server.url)
    keys = Keys(NAMESPACE)
    try:
        config = {
            "redis_url": server.url,
            "namespace": NAMESPACE,
            "model": spec_raw,
            "batching": {"max_batch_size": options.max_batch, "window_ms": options.window_ms},
            "gpu_worker": {"sim_latency_ms": options.profile_ms()},
            **options.extra_config,
        }
        config_path = workdir / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        model_key = f"{spec_raw['name']}:{spec_raw['version']}"
        ids, push_s = push_frames(client, keys, model_key, contents, options.frames)
        log(f"pushed {len(ids)} frames of {frame_bytes / 1024:.0f} KB in {push_s:.2f} s")
        worker = _start_worker(options, config_path, workdir)
        profiler = _profiler(options, worker)
        cpu_before = cpu_times()
        try:
            wait_until(
                lambda: _all_answered(client, keys, len(ids)) or not worker.alive(),
                600,
                interval_s=0.05,
                what="the worker to drain the frames",
            )
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                profiler.wait(60)
            if not worker.alive():
                raise RuntimeError(f"the GPU worker died:\n{worker.log_tail()}")
            counters = _counters(client, keys)
            cpu = cpu_shares(cpu_before, cpu_times())
        finally:
            worker.stop()
        measured = _throughput(client, keys, ids)
        limit_fps, limit_how = device_limit(options, counters, measured["mean_batch"])
        redis_fps = redis_drain_rate(client, keys, model_key, contents, options) if options.redis_check else None
    finally:
        client.close()
        server.stop()
    result = {
        "options": {
            **asdict(options),
            "model": str(options.model),
            "py_spy": str(options.py_spy or "") or None,
            "profile_ms": options.profile_ms(),
        },
        "run": run_label(options),
        "frame_kb": round(frame_bytes / 1024, 1),
        "frames_per_s": round(measured["fps"], 1),
        "device_limit_fps": round(limit_fps, 1),
        "device_limit": limit_how,
        "share_of_limit": round(measured["fps"] / limit_fps, 4),
        "mean_batch": round(measured["mean_batch"], 3),
        "statuses": measured["statuses"],
        "host_ms_per_batch": host_ms_per_batch(counters),
        "push_fps": round(len(ids) / push_s, 1),
        "machine_cpu": cpu,
        "redis_limit_fps": round(redis_fps, 1) if redis_fps else None,
    }
    return result


def _start_worker(options: FeedOptions, config_path: Path, workdir: Path) -> ManagedProcess:
    env = {
        **os.environ,
        "IMGSERVE_CONFIG": str(config_path),
        "PYTHONUNBUFFERED": "1",
        "IMGSERVE_LOGS__LEVEL": "WARNING",
    }
    env.pop("IMGSERVE_REDIS_URL", None)
    return ManagedProcess(
        "gpu-worker",
        gpu_worker_argv(options.device, WORKER_ID),
        env,
        workdir,
    )


def _profiler(options: FeedOptions, worker: ManagedProcess) -> subprocess.Popen | None:
    """py-spy attached to the worker, sampling only the thread that holds the GIL (collapsed stacks,
    one line per stack), until interrupted. py-spy is not a dependency: `pip install py-spy` first."""
    if not options.py_spy:
        return None
    return subprocess.Popen(
        [
            "py-spy",
            "record",
            "--format",
            "raw",
            "--rate",
            "500",
            "--threads",
            "--gil",
            "--nonblocking",
            "--pid",
            str(worker.process.pid),
            "--output",
            str(options.py_spy),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _all_answered(client: redis.Redis, keys: Keys, count: int) -> bool:
    frames = client.hget(keys.gpu_counters(WORKER_ID), "frames_total")
    return frames is not None and int(float(frames)) >= count


def _counters(client: redis.Redis, keys: Keys) -> dict[str, float]:
    raw = client.hgetall(keys.gpu_counters(WORKER_ID))
    return {(name.decode() if isinstance(name, bytes) else name): float(value) for name, value in raw.items()}


def _throughput(client: redis.Redis, keys: Keys, ids: list[str]) -> dict[str, Any]:
    """Steady state: frames written after the first batch's write, over the time to the last write."""
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job(job_id), "status", "finished_at", "batch")
    rows = pipe.execute()
    statuses: dict[str, int] = {}
    finished, batches = [], {}
    for status, finished_at, batch in rows:
        name = status.decode() if status else "missing"
        statuses[name] = statuses.get(name, 0) + 1
        if finished_at:
            finished.append(float(finished_at))
        if batch:
            info = json.loads(batch)
            batches[info["id"]] = info["size"]
    finished.sort()
    first_batch = min(finished.count(finished[0]), len(finished) - 1) if finished else 0
    span = finished[-1] - finished[0] if len(finished) > 1 else 0.0
    fps = (len(finished) - first_batch) / span if span > 0 else 0.0
    sizes = list(batches.values())
    return {"fps": fps, "mean_batch": sum(sizes) / len(sizes) if sizes else 0.0, "statuses": statuses}


def redis_drain_rate(
    client: redis.Redis, keys: Keys, model_key: str, contents: list[tuple[dict[str, Any], bytes]], options: FeedOptions
) -> float:
    """Frames/s of the worker's Redis calls alone (take a batch, ack it): Redis's own ceiling here."""
    from contract.frames.frame_source import RedisFrameSource

    client.delete(keys.frames(model_key))
    push_frames(client, keys, model_key, contents, options.frames)
    source = RedisFrameSource(client, keys, "redis-check", model_key)
    taken, started = 0, time.perf_counter()
    while True:
        frames = source.pop_available(options.max_batch)
        if not frames:
            break
        source.ack(len(frames))
        taken += len(frames)
    return taken / (time.perf_counter() - started)


# --- the report -----------------------------------------------------------
def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "## bench feed: one GPU worker against the device's limit",
        "",
        "| device | profile | input | frame KB | frames/s | device limit | share | mean batch | "
        "Redis limit | push | CPU busy / stolen |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o = r["options"]
        profile = o["profile"] if o["device"] == "sim" else "-"
        lines.append(
            f"| {r['run']} | {profile} | {o['input_size']} | {r['frame_kb']:.0f} | "
            f"{r['frames_per_s']:.0f} | {r['device_limit_fps']:.0f} | **{r['share_of_limit']:.0%}** | "
            f"{r['mean_batch']:.2f} | {_fmt(r['redis_limit_fps'])} | {r['push_fps']:.0f} | "
            f"{_shares(r['machine_cpu'])} |"
        )
    stages = [s for s in HOST_STAGES if any(s in r["host_ms_per_batch"] for r in results)]
    if stages:
        lines += [
            "",
            "Host time per batch by stage, ms (wall / CPU of the stage's thread):",
            "",
            "| run | " + " | ".join(stages) + " |",
            "|---|" + "---|" * len(stages),
        ]
        for r in results:
            o, table = r["options"], r["host_ms_per_batch"]
            cells = [f"{table[s]['wall']:.2f} / {table[s]['cpu']:.2f}" if s in table else "-" for s in stages]
            lines.append(
                f"| {r['run']} {o['profile'] if o['device'] == 'sim' else ''} {o['input_size']} | "
                + " | ".join(cells)
                + " |"
            )
    lines += [
        "",
        "Device limit: " + "; ".join(sorted({r["device_limit"] for r in results})) + ". "
        "Share: frames/s over that limit, measured from the first batch's write to the last. "
        "Redis limit: one consumer taking and acking frames with the worker's own calls, nothing else. "
        "CPU: the machine's cores during the drain, busy and stolen by the hypervisor.",
    ]
    return "\n".join(lines)


def run_label(options: FeedOptions) -> str:
    """The device, and what of the model differs from the default spec: a row's name in tables."""
    model = "" if options.model == DEFAULT_SPEC else f" {options.model.stem}"
    return options.device + model + "".join(f" {key}={value}" for key, value in options.model_options.items())


def _shares(cpu: dict[str, float] | None) -> str:
    return "-" if not cpu else f"{cpu['busy']:.0%} / {cpu['steal']:.0%}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
