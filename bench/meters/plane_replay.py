"""A deterministic replay of a job's Redis steps against a control plane under callgrind: what each step costs Redis
in user-space instructions an image, without `bench plane`'s processes, HTTP or idle chatter.

`bench plane --instructions` is the figure of record, but it takes each step's idle rate out of it, and on a loaded
machine that moves a step by 15,000-25,000 instructions from run to run. Here the product's own step facades run one
after the other from this process, on N jobs: the intake (`JobIntake.create`, one bulk shard), the claim
(`JobHandOff`), the push (`ShardedFramePusher`), the GPU worker's advance to `running` (`advance_many`) and its batch
write (the library's `write_batch`, built as `gpu_worker.finish.Finisher` builds it), in batches of 8, then a read of
each record (`JobStore.load`, the API's) and its deletion (what its expiry costs Redis). The control plane runs with
`--hz 1`, so its cron adds next to nothing, and `callgrind_control -d` splits the steps; runs of one build agree
within ~1,500 instructions a step (a run now and then reads a few thousand higher in every step). The result
cache's books and the deadline index start past their listpack sizes, as in service.

    python -m bench.meters.plane_replay [--jobs 400] [-- --redis-option value ...]

Redis's options after `--` come after the checkout's configs/redis.conf, to price a setting (e.g.
`-- --hash-max-listpack-entries 512 --hash-max-listpack-value 4096`: the settings before round three). Prints one
JSON line: instructions an image by step, and an ended record's bytes (MEMORY USAGE) and encoding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import yaml

from bench.meters.plane import plane_config
from bench.meters.plane_meter import InstructionCounter
from bench.stack.processes import RedisServer
from contract.cache import CacheLimits
from contract.frames.frame_shards import ShardedFramePusher
from contract.jobs.handoff import JobHandOff
from contract.jobs.intake import JobIntake
from contract.jobs.record import RUNNING, SUCCEEDED
from contract.library import Step, ensure_library
from contract.redis.keys import Keys
from contract.redis.shards import BulkPlane
from contract.settings.config import load_settings

MODEL = "shapes-yolo:2.0.0"
# What bench plane's jobs carry and are answered with (a 640x16 JPEG, the sim device's four detections).
INTAKE_FIELDS = {
    "model": MODEL,
    "bytes": "789",
    "options": "{}",
    "media_type": "image/jpeg",
    "cache": "miss",
    "queue": f"preprocess:{MODEL}",
}
PUSH_STAMPS = {"decode_ms": 6.370335999974941, "resize_ms": 0.06353899999567147, "backpressure_ms": 0.0044189999}
DETECTION = {"box": [514.63, 11.91, 576.0, 14.39], "score": 0.8878, "class_id": 1, "label": "square"}
RESULT = {
    "detections": [DETECTION] * 4,
    "image": {"width": 640, "height": 16},
    "model": {"name": "shapes-yolo", "version": "2.0.0"},
}
TIMINGS = {
    "receive": 51.376,
    "queue_cpu": 4058.003,
    "decode": 6.37,
    "resize": 0.064,
    "backpressure": 0.004,
    "queue_gpu": 6871.603,
    "batch_wait": 5.608,
    "device_queue": 4.709,
    "infer": 0.1,
    "postprocess": 0.198,
    "total": 11003.38,
}
STEPS = ("intake", "claim", "push", "advance", "end", "read")
_WRITE_BATCH = Step("write_batch")
WORKER, EPOCH = "replay-gpu", "1"


def replay(jobs: int, batch: int, redis_options: list[str]) -> dict[str, Any]:
    """Each step's instructions an image over `jobs` jobs (`batch` a GPU batch), an ended record's bytes and
    encoding."""
    work = Path(tempfile.mkdtemp(prefix="plane-replay-"))
    counter = InstructionCounter(work)
    control = RedisServer(work, wrapper=counter.wrapper(), extra_args=("--hz", "1", *redis_options))
    counter.pid = control.process.pid
    (work / "shard").mkdir()
    shard = RedisServer(work / "shard")
    try:
        return _steps(control.url, shard.url, work, counter, jobs, batch)
    finally:
        control.stop()
        shard.stop()
        shutil.rmtree(work, ignore_errors=True)


def _steps(url: str, shard_url: str, work: Path, counter: InstructionCounter, jobs: int, batch: int) -> dict[str, Any]:
    (work / "config.yaml").write_text(yaml.safe_dump(plane_config(url, [shard_url], jobs)))
    settings = load_settings(work / "config.yaml")
    keys, client = Keys(settings.namespace), redis.Redis.from_url(url)
    ensure_library(client)
    bulk = BulkPlane(client, [redis.Redis.from_url(shard_url)])
    cache = CacheLimits.of(settings, keys)
    intake = JobIntake(client, keys, settings.jobs.ttl_s, bulk=bulk, cache=cache)
    handoff = JobHandOff(client, keys, settings.jobs.ttl_s, bulk)
    pusher = ShardedFramePusher(client, keys, bulk)
    now = time.time()
    pipe = client.pipeline(transaction=False)
    # The cache's books and the deadline index past their listpack sizes (Redis's hash-max-listpack-entries, 512
    # by default here, and zset-max-listpack-entries), as in service: a cache of fewer digests than that keeps its
    # sizes hash a listpack, and each answer's HMGET and HSET walk it (bench plane's 300 images never leave it).
    for i in range(600):
        pipe.zadd(keys.cache_prefix + "lru", {f"old{i}": now - 10})
        pipe.hset(keys.cache_prefix + "sizes", f"old{i}", 300)
        pipe.zadd(keys.deadlines, {f"later{i}": now + 7200})
    pipe.set(keys.gpu_epoch(WORKER), EPOCH)
    pipe.execute()
    ids = [f"{i:032x}" for i in range(1, jobs + 1)]
    upload, frame, claims = os.urandom(789), os.urandom(8000), {}

    def create(n: int, job_id: str) -> None:
        fields = {
            **INTAKE_FIELDS,
            "deadline_at": repr(now + 3600),
            "cache_key": f"{n:064x}",
            "received_at": repr(now),
            "submitted_at": repr(now + 0.05),
        }
        intake.create(job_id, upload, settings.jobs.upload_ttl_s, fields, (fields["queue"], b"m" * 1200))

    def claim(job_id: str) -> None:
        claims[job_id] = os.urandom(16).hex()
        assert handoff.claim_for_preprocessing(job_id, time.time(), claims[job_id]).verdict == "claimed"

    def push(job_id: str) -> None:
        stamps = {**PUSH_STAMPS, "pushed_at": time.time()}
        assert pusher.push(job_id, MODEL, frame, 100_000, stamps, claim=claims[job_id]) == 1

    batches = [ids[i : i + batch] for i in range(0, len(ids), batch)]

    def write(seq: int, job_ids: list[str]) -> None:
        outcomes = [
            (job_id, SUCCEEDED, {"timings": TIMINGS, "batch": _batch(seq, len(job_ids), i), "result": RESULT})
            for i, job_id in enumerate(job_ids)
        ]
        job_keys, job_args = intake.finish_arguments(outcomes)
        counters = [f"frames_total:{MODEL}", seq * batch]
        written = _WRITE_BATCH(
            client,
            [keys.callback_outbox, "", keys.gpu_counters(WORKER), keys.gpu_epoch(WORKER), keys.frames_waiting, ""]
            + job_keys,
            [*intake.finish_names(), len(job_ids), 8000 * len(job_ids), MODEL, 2, EPOCH, 0, *counters, *job_args],
        )
        assert written == len(job_ids), written

    def each(step: Callable[..., object], items: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for item in items:
                step(*item)

        return run

    work_of: dict[str, Callable[[], None]] = {
        "intake": each(create, list(enumerate(ids))),
        "claim": each(claim, [(job_id,) for job_id in ids]),
        "push": each(push, [(job_id,) for job_id in ids]),
        "advance": each(
            lambda job_ids: intake.advance_many(job_ids, RUNNING, settings.gpu_worker.max_attempts),
            [(job_ids,) for job_ids in batches],
        ),
        "end": each(write, list(enumerate(batches, 1))),
        "read": each(intake.load, [(job_id,) for job_id in ids]),
    }
    costs: dict[str, Any] = {}
    counter.mark()
    for step in STEPS:
        work_of[step]()
        costs[step] = round(counter.mark() / jobs)
    sizes = [int(client.memory_usage(keys.job(job_id), samples=0) or 0) for job_id in ids[:50]]
    encoding = client.object("encoding", keys.job(ids[0]))
    for job_id in ids:
        client.delete(keys.job(job_id))
    costs["delete"] = round(counter.mark() / jobs)
    costs["gpu"] = costs["advance"] + costs["end"]
    costs["all"] = sum(costs[step] for step in STEPS)
    text = encoding.decode() if isinstance(encoding, bytes) else str(encoding)
    return {**costs, "record_bytes": sum(sizes) / len(sizes), "encoding": text}


def _batch(seq: int, size: int, index: int) -> dict[str, Any]:
    return {"id": f"{WORKER}:{seq}", "seq": seq, "size": size, "index": index, "closed_by": "full", "worker": WORKER}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("redis_options", nargs="*", help="redis-server options, after --")
    args = parser.parse_args(argv)
    print(json.dumps({"options": args.redis_options, **replay(args.jobs, args.batch, args.redis_options)}))


if __name__ == "__main__":
    main()
