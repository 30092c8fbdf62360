"""The commands that measure one part alone: the GPU worker fed in advance, the device profile's latency floor,
post-processing's worst cases, and instructions per API request or CPU task under valgrind."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.commands.common import log_line, parse_list, parse_option, write_files
from bench.stack.corpus import load_corpus
from bench.stack.processes import REPO_ROOT


def add_commands(
    sub: Any, common: argparse.ArgumentParser, local: argparse.ArgumentParser
) -> dict[str, Callable[[argparse.Namespace], int]]:
    bound = sub.add_parser("bound", help="the latency floor the device profile alone allows")
    bound.add_argument("--qps", type=parse_list(float), default=[10.0, 18.0, 26.0, 28.0, 30.0])
    bound.add_argument("--window-ms", type=float, default=12.0)
    bound.add_argument("--max-batch", type=int, default=8)
    nms = sub.add_parser("nms", help="post-processing's worst cases per batch (conf=0), on this machine's CPU")
    nms.add_argument("--batch", type=int, default=8)
    nms.add_argument("--max-candidates", type=int, default=1000)
    nms.add_argument("--max-det", type=parse_list(int), default=[100, 1000])
    nms.add_argument(
        "--neighbours",
        action="store_true",
        help="instead: a batch of shapes-yolo frames at their defaults, then with one at conf=0, iou=1, max_det=1000",
    )
    nms.add_argument("--device", default="cpu", help="with --neighbours: cpu, cuda or cuda:N")
    reads = sub.add_parser(
        "reads", help="the API's CPU per read of a job: a 1,000-detection answer against a small one"
    )
    reads.add_argument("--reads", type=int, default=300, help="reads of each job")
    reads.add_argument("--flood", action="store_true", help="instead: the probe's flood of rereads on a local stack")
    reads.add_argument("--connections", type=int, default=8, help="--flood: clients re-reading the job")
    reads.add_argument("--seconds", type=float, default=30.0, help="--flood: how long the flood lasts")
    reads.add_argument("--base", help="--flood: a git ref flooded first, the same way (checked out under .bench/ab/)")
    reads.add_argument("--detections", type=int, default=1000, help="--flood: the job's detections")
    instructions = sub.add_parser(
        "instructions",
        help="instructions per API request pair or CPU task (valgrind): "
        "a figure this shared machine's drift does not move",
    )
    instructions.add_argument(
        "--role",
        type=parse_list(str),
        default=["api", "cpu-task"],
        help="api (a submit and its long-poll), cpu-task (one preprocess task)",
    )
    instructions.add_argument("--base", help="a git ref counted too, beside this checkout")
    instructions.add_argument(
        "--cells",
        type=int,
        help="api: the API (this checkout's, and --base's) in front of one cell, then of N cells (docs/cells.md)",
    )
    instructions.add_argument(
        "--pairs",
        type=parse_list(int),
        default=[20, 100],
        help="api: the two runs' submits (their difference counts); marked: the second, counted in one run",
    )
    instructions.add_argument(
        "--marked",
        action="store_true",
        help="api: one run counted between marks, its idle rate taken out (always so with --cells): "
        "bench/meters/instructions_api.py",
    )
    feed = sub.add_parser("feed", help="the GPU worker alone, draining frames pushed in advance")
    feed.add_argument("--device", default="sim", help="sim | cpu | cuda | cuda:N")
    feed.add_argument(
        "--profile",
        type=parse_list(str),
        default=["fast"],
        help="sim latency profiles, each fast, story or 1:2,8:6,16:10 (ms per batch size)",
    )
    feed.add_argument("--frames", type=int, default=1600, help="frames pushed in advance")
    feed.add_argument("--input-size", type=parse_list(int), default=[320], help="model input sizes, e.g. 320,640")
    feed.add_argument(
        "--source",
        choices=("jpeg", "synthetic"),
        default="jpeg",
        help="jpeg: the real CPU stage on generated JPEGs; synthetic: random content",
    )
    feed.add_argument("--image-size", default="640x480", help="WxH of the images the frames come from")
    feed.add_argument("--max-batch", type=int, default=8)
    feed.add_argument("--window-ms", type=float, default=12.0)
    feed.add_argument("--model", type=Path, help="the model spec file (default: shapes-yolo)")
    feed.add_argument(
        "--model-option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a spec field over the file's, e.g. accelerate=cuda_graphs or precision=fp16 (repeatable)",
    )
    feed.add_argument("--no-redis-check", action="store_true", help="skip measuring Redis's own drain rate")
    feed.add_argument("--py-spy", type=Path, help="profile the worker with py-spy into this file (collapsed stacks)")
    feed.add_argument("--out", type=Path, default=Path(".bench") / "results")
    plane = sub.add_parser(
        "plane",
        help="the control plane's Redis per image, step by step (intake, cpu, gpu, read), and its ceiling: "
        "images/s per control-plane core",
    )
    plane.add_argument("--images", type=int, default=1000)
    plane.add_argument("--shards", type=int, default=1, help="bulk shards (uploads and frames off the control plane)")
    plane.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients of the intake and read steps")
    plane.add_argument("--base", help="a git ref run too, before this checkout (a worktree)")
    plane.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --base: run the base and this checkout alternately N times, each first in every other round "
        "(base, checkout; checkout, base; ...), and report each round, each side's median and the median of the "
        "rounds' ratios (checkout/base)",
    )
    plane.add_argument(
        "--instructions",
        action="store_true",
        help="run the control plane's Redis under callgrind and count its instructions an image per step: a figure "
        "the machine's drift does not move (slow: use a few hundred images)",
    )
    plane.add_argument(
        "--keyed", action="store_true", help="every submission with an API key (its queue and its byte shares counted)"
    )
    plane.add_argument(
        "--cache-redis",
        action="store_true",
        help="this checkout with the result cache on a Redis of its own (cache.redis_url, allkeys-lru): its cost "
        "reported apart from the control plane's (--base runs as it is)",
    )
    plane.add_argument(
        "--cells",
        type=int,
        help="N cells behind one API against one cell, in one run (bench/meters/plane_cells.py): each cell's cost an "
        "image, the split, the deployment's ceiling; --images is then a cell's",
    )
    plane.add_argument(
        "--pin",
        action="store_true",
        help="--cells: each cell's Redis main thread held to a core of its own (as far as there are cores)",
    )
    plane.add_argument("--out", type=Path, default=Path(".bench") / "results")
    burst = sub.add_parser(
        "burst",
        help="a burst on make run's stack with a fixed pool of 1, a fixed pool at --max and the pool autoscaled "
        "between them (CPU_AUTOSCALE): p95, images/s, idle memory, how soon it grew and shrank",
    )
    burst.add_argument("--burst", type=int, default=120, help="uploads sent at once")
    burst.add_argument("--max", type=int, default=3, help="the fixed pool's size and the autoscaled pool's maximum")
    burst.add_argument("--keepalive-s", type=float, default=10.0, help="Celery's shrink delay (AUTOSCALE_KEEPALIVE)")
    burst.add_argument("--idle-s", type=float, default=60.0, help="the longest wait for the pool to shrink back")
    burst.add_argument("--out", type=Path, default=Path(".bench") / "results")
    return {
        "bound": cmd_bound,
        "nms": cmd_nms,
        "reads": cmd_reads,
        "instructions": cmd_instructions,
        "feed": cmd_feed,
        "plane": cmd_plane,
        "burst": cmd_burst,
    }


def _plane_cells(args: argparse.Namespace) -> int:
    from bench.meters import plane_cells

    text, sides = plane_cells.run(args.cells, args.images, args.shards, args.clients, args.instructions, args.pin)
    summary = {
        name: {
            "per_cell": [
                {
                    "images": c["images"],
                    "total": vars(c["total"]),
                    "phases": {p: vars(v) for p, v in c["phases"].items()},
                    "main_thread": c["main_thread"],
                }
                for c in side["per_cell"]
            ]
        }
        for name, side in sides.items()
        if name != "verdict"
    }
    payload = {"title": "bench plane --cells", "sides": summary, "verdict": sides["verdict"]}
    print(text + f"\n\nFiles: {write_files(args.out, 'plane-cells', text, payload)}")
    return 0 if sides["verdict"]["met"] else 1


def cmd_burst(args: argparse.Namespace) -> int:
    import tempfile

    from bench.load import burst

    with tempfile.TemporaryDirectory(prefix="bench-burst-") as folder:
        text, runs = burst.run(args.burst, args.max, args.keepalive_s, args.idle_s, Path(folder))
    payload = {"title": "bench burst", "runs": burst.summary(runs)}
    print(text + f"\n\nFiles: {write_files(args.out, 'burst', text, payload)}")
    return 0


def cmd_plane(args: argparse.Namespace) -> int:
    from bench.meters.plane import run
    from bench.meters.plane_report import round_medians, rounds_summary

    if args.cells:
        return _plane_cells(args)
    if args.rounds < 1:
        raise SystemExit("--rounds: 1 or more")
    text, rounds = run(
        args.images,
        args.shards,
        args.clients,
        args.base,
        args.instructions,
        args.keyed,
        args.cache_redis,
        args.rounds,
    )
    summaries = [
        {
            name: {
                "phases": {phase: vars(cost) for phase, cost in side["phases"].items()},
                "apart": {phase: vars(cost) for phase, cost in side["apart"].items()},
                "total": vars(side["total"]),
                "cache_phases": {phase: vars(cost) for phase, cost in side.get("cache_phases", {}).items()},
                "ended": side["ended"],
                "record": side["record"],
            }
            for name, side in sides.items()
        }
        for sides in rounds
    ]
    if len(rounds) == 1:
        payload: dict[str, Any] = {"title": "bench plane", "sides": summaries[0]}
    else:
        payload = {"title": "bench plane", "rounds": summaries, "medians": round_medians(rounds)}
    summary = "\n\n" + rounds_summary(rounds) if len(rounds) > 1 else ""
    # the summary last, under the files' line: what a run of several rounds comes to, in a line a measure
    print(text + f"\n\nFiles: {write_files(args.out, 'plane', text + summary, payload)}" + summary)
    return 0


def cmd_bound(args: argparse.Namespace) -> int:
    from bench.meters.bound import describe
    from contract.settings.config import load_settings

    print(describe(load_settings().gpu_worker.sim_latency_ms, args.qps, args.window_ms, args.max_batch))
    return 0


def cmd_nms(args: argparse.Namespace) -> int:
    from bench.meters.nms import describe as describe_nms
    from bench.meters.nms import describe_neighbours

    if args.neighbours:
        print(describe_neighbours(args.batch, args.device))
        return 0
    print("\n\n".join(describe_nms(args.batch, args.max_candidates, max_det) for max_det in args.max_det))
    return 0


def cmd_reads(args: argparse.Namespace) -> int:
    from bench.load.reads import describe as describe_reads

    if args.flood:
        from bench.load.reads_flood import describe_flood

        print(describe_flood(args.connections, args.seconds, args.base, args.detections))
        return 0
    print(describe_reads(args.reads))
    return 0


def cmd_feed(args: argparse.Namespace) -> int:
    from bench.meters.feed import FeedOptions, markdown, run_feed

    width, height = (int(v) for v in args.image_size.lower().split("x"))
    profiles = args.profile if args.device == "sim" else args.profile[:1]
    results = []
    for size in args.input_size:
        for profile in profiles:
            options = FeedOptions(
                device=args.device,
                profile=profile,
                frames=args.frames,
                input_size=size,
                source=args.source,
                image_size=(width, height),
                max_batch=args.max_batch,
                window_ms=args.window_ms,
                redis_check=not args.no_redis_check,
                py_spy=args.py_spy,
                model_options=dict(args.model_option),
                **({"model": args.model.resolve()} if args.model else {}),
            )
            results.append(run_feed(options, log=log_line))
            print(
                f"  {args.device} {profile} {size}: {results[-1]['frames_per_s']:.0f} frames/s, "
                f"{results[-1]['share_of_limit']:.0%} of the limit",
                file=sys.stderr,
            )
    text = markdown(results)
    print(text + f"\n\nFiles: {write_files(args.out, 'feed', text, {'title': 'bench feed', 'results': results})}")
    return 0


def cmd_instructions(args: argparse.Namespace) -> int:
    from bench.load.ab import worktree
    from bench.meters import instructions, instructions_api

    unknown = [role for role in args.role if role not in instructions.ROLES]
    if unknown:
        raise SystemExit(f"--role {','.join(unknown)}: expected some of {', '.join(instructions.ROLES)}")
    if args.cells is not None and (args.role != ["api"] or not 2 <= args.cells <= 16):
        raise SystemExit("--cells N (2 to 16) counts --role api, one cell against N")
    roots = {**({f"A {args.base}": worktree(args.base)} if args.base else {}), "this checkout": REPO_ROOT}
    sides: dict[str, tuple[Path, int]] = {}
    for name, root in roots.items():
        if args.cells:  # each build in front of one cell, then N
            sides[f"{name}: one cell"] = (root, 1)
            sides[f"{name}: {args.cells} cells"] = (root, args.cells)
        else:
            sides[name] = (root, 1)
    images = load_corpus(None, count=4)
    pairs = (args.pairs[0], args.pairs[1])
    counted: dict[str, list] = {}
    for role in args.role:
        for side, (root, cells) in sides.items():
            found = instructions_api.count(role, root, images, cells, pairs, args.marked or bool(args.cells))
            counted.setdefault(side, []).append(found)
            idle = f", {found.idle_per_s / 1e6:.2f} M a second idle" if found.idle_per_s is not None else ""
            print(f"  {side} {role}: {found.per_unit / 1e6:.2f} M instructions{idle}", file=sys.stderr)
    print(instructions.markdown(counted))
    if args.cells:
        for name in roots:
            ratio = counted[f"{name}: {args.cells} cells"][0].per_unit / counted[f"{name}: one cell"][0].per_unit
            print(f"\n{name}: {args.cells} cells / one cell: {ratio:.3f}x (target <= 1.05x)")
    return 0
