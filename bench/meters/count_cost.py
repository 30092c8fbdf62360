"""`python -m bench.meters.count_cost`: what counting a key's frames (`backpressure.head_frames_per_key`,
Keys.key_frames) costs Redis an image in the CPU step, counted apart from everything else the step does.

`bench plane --instructions` prices whole steps, and its figures move by several percent between runs (the idle
chatter priced out of each step, the order of the two sides): more than the count itself. This meter runs one
redis-server under callgrind (`--hz 1`: its timers' work, which moves with the client's pace, kept to a minimum)
and, for N keyed jobs, counts its instructions over the N claims and over the N pushes, with the count on and off,
in alternating rounds. `--root PATH` measures another checkout's code (a worktree of the base): the steps are the
library and the contract of the checkout they run from. The batch write's count-out (one HINCRBY a key a batch)
is the same before and after the change this was written for, and is not measured here.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROUNDS = 4  # on/off alternated: off, on, on, off, ...


def _child(images: int, sharded: bool) -> dict[str, list[float]]:
    """In a process whose `contract` is the measured checkout's: claims and pushes, instructions an image."""
    import redis

    from bench.meters.plane_meter import InstructionCounter
    from bench.stack.processes import RedisServer
    from contract.frames import frame_push
    from contract.frames.frame_shards import frame_pusher
    from contract.jobs.handoff import JobHandOff
    from contract.jobs.intake import JobIntake
    from contract.library import ensure_library
    from contract.redis.keys import Keys
    from contract.redis.shards import BulkPlane

    folder = Path(tempfile.mkdtemp(prefix="count-cost-"))
    counter = InstructionCounter(folder)
    control = RedisServer(folder, extra_args=("--hz", "1"), wrapper=counter.wrapper())
    counter.pid = control.process.pid
    shard_server = RedisServer(folder) if sharded else None
    client = redis.Redis.from_url(control.url)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    shard = redis.Redis.from_url(shard_server.url) if shard_server else None
    ensure_library(client)
    if shard is not None:
        ensure_library(shard)
    # the pusher of a checkout from before the count moved to the claim takes the count's switch too
    pusher_counts = "count_key_frames" in inspect.signature(frame_pusher).parameters
    figures: dict[str, list[float]] = {"claim on": [], "push on": [], "claim off": [], "push off": []}
    try:
        for round_ in range(ROUNDS):
            for counted in (False, True) if round_ % 2 == 0 else (True, False):
                keys = Keys(f"count-cost-{round_}-{int(counted)}")
                bulk = BulkPlane(client, [shard]) if shard is not None else None
                intake = JobIntake(client, keys, ttl_s=600, bulk=bulk)
                handoff = JobHandOff(client, keys, ttl_s=600, bulk=bulk, count_key_frames=counted)
                extra: dict[str, Any] = {"count_key_frames": counted} if pusher_counts else {}
                pusher = frame_pusher(client, keys, bulk, **extra)
                jobs = [f"{round_}{int(counted)}{i:030x}" for i in range(images)]
                fields = {"model": "m:1", "bytes": 6, "deadline_at": 1e12, "owner": "k"}
                for job in jobs:
                    intake.create(job, b"upload", 600, fields)
                counter.mark()
                for job in jobs:
                    handoff.claim_for_preprocessing(job, 1.0, "c")
                claims = counter.mark() / images
                for job in jobs:
                    pushed = pusher.push(job, "m:1", b"f" * 64, 10 * images, {"pushed_at": 1.0}, "c")
                    assert pushed == frame_push.PUSHED, pushed
                pushes = counter.mark() / images
                side = "on" if counted else "off"
                figures[f"claim {side}"].append(claims)
                figures[f"push {side}"].append(pushes)
    finally:
        control.stop()
        if shard_server is not None:
            shard_server.stop()
    return figures


def measure(root: Path, images: int, sharded: bool) -> dict[str, list[float]]:
    """The figures of the checkout at `root` (its code, this meter's file)."""
    root = root.resolve()
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [sys.executable, __file__, "--child", "--images", str(images), *(["--sharded"] if sharded else [])]
    done = subprocess.run(argv, cwd=root, env=env, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(name: str, figures: dict[str, list[float]]) -> tuple[str, str]:
    """A table row (medians of the rounds) and each round's figures."""
    med = {k: statistics.median(v) for k, v in figures.items()}
    cost = (med["claim on"] + med["push on"]) - (med["claim off"] + med["push off"])
    row = (
        f"| {name} | {med['claim off']:,.0f} -> {med['claim on']:,.0f} | {med['push off']:,.0f} -> "
        f"{med['push on']:,.0f} | {cost:+,.0f} |"
    )
    return row, f"{name}, each round: " + "; ".join(
        f"{k} {', '.join(f'{x:,.0f}' for x in v)}" for k, v in figures.items()
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--sharded", action="store_true", help="one bulk shard (uploads and frames off the plane)")
    parser.add_argument("--root", type=Path, action="append", default=[], help="a checkout to measure (repeatable)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.images, args.sharded)))
        return 0
    roots = args.root or [Path(__file__).resolve().parents[2]]
    where = "one bulk shard" if args.sharded else "no shard"
    print(f"Redis instructions an image, {args.images} keyed jobs, {where}: medians of the rounds, count off -> on\n")
    print("| checkout | claim | push | the count, claim and push |\n|---|---|---|---|")
    details = []
    for root in roots:
        row, detail = describe(str(root), measure(root, args.images, args.sharded))
        print(row, flush=True)
        details.append(detail)
    print("\n" + "\n\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
