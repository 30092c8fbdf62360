"""bench: load a deployment over real HTTP and report where the time goes.

  python -m bench run --url http://localhost:8000 --closed 1,8,32 --open-qps 18
  python -m bench compare --device sim               # starts the pipeline and the serial baseline here
  python -m bench ceiling --device sim --qps 24,26,28,30 --sla-ms 800
  python -m bench diagnose --url http://localhost:8000
  python -m bench tune --device sim --qps 18 --sla-ms 800
  python -m bench chaos --device sim --qps 8 --duration 60  # kills workers and Redis under load
  python -m bench chaos --scenario failover --qps 20 --duration 40   # the Redis primary SIGKILLed (Sentinel)
  python -m bench hostile --attack slow-callbacks --duration 60   # one tenant's tarpit, another's callbacks
  python -m bench bound --qps 18,28                         # the floor the device profile allows
  python -m bench feed --device sim --profile fast,story    # the GPU worker alone vs the device's limit
  python -m bench run --stack local --profile fast --closed 32 --open-qps ''   # make run's stack vs the decode floor
  python -m bench ab --base HEAD~1 --profile fast --closed 32 --rounds 3     # two builds, runs alternating
  python -m bench instructions --role api,cpu-task --base HEAD~1  # instructions per request / task, two builds
  python -m bench hostile --attack images --base HEAD~1   # hostile image files; what a normal tenant saw

Reports go to the terminal (Markdown) and to --out (JSON, Markdown, PNG charts).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from bench import charts, load
from bench.corpus import load_corpus
from bench.processes import REPO_ROOT
from bench.profiles import parse_profile
from bench.report import markdown
from bench.runs import CpuScope, hit_cost, measure, meets_sla
from bench.stack import BaselineServer, LocalStack, ProcfileStack, StackOptions


def write_report(results: list[dict[str, Any]], out: Path, title: str, extra: dict | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results, title)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{stamp}-report.md").write_text(text + "\n")
    (out / f"{stamp}-report.json").write_text(json.dumps({"title": title, "results": results, **(extra or {})},
                                                         indent=2))
    made = [charts.concurrency_chart(results, out / f"{stamp}-concurrency.png"),
            charts.time_bill_chart(results, out / f"{stamp}-time-bill.png")]
    return text + "\n\nFiles: " + ", ".join(str(p) for p in [out / f"{stamp}-report.json", *made] if p)


def run_suite(name: str, url: str, images: list[bytes], args: argparse.Namespace,
              open_loop: bool = True, scope: CpuScope | None = CpuScope()) -> list[dict[str, Any]]:
    model = getattr(args, "model", None)
    upload = getattr(args, "upload", "raw")
    shares = getattr(args, "repeat_share", None) or [0.0]
    calls = getattr(args, "calls", None) or ["two"]
    results = [measure(name, url, images, "closed", c, args.closed_duration, scope=scope, model=model, upload=upload,
                       repeat_share=share, one_call=call == "one")
               for c in args.closed for share in shares for call in calls]
    for result in results:   # each share's hit cost, against the same load without repeats
        plain = next((r for r in results if r["concurrency"] == result["concurrency"] and not r["repeat_share"]
                      and r["calls"] == result["calls"]), None)
        if result["repeat_share"] and plain is not None:
            result["cache_hit_cost"] = hit_cost(plain, result)
            print(f"  repeats {result['repeat_share']:.0%}: {result['cache_hit_cost']}", file=sys.stderr)
    if open_loop:
        results += [measure(name, url, images, "open", q, args.open_duration, scope=scope, model=model,
                            upload=upload)
                    for q in args.open_qps]
    return results


def stack_options(args: argparse.Namespace, **overrides: Any) -> StackOptions:
    values = dict(device=args.device, cpu_workers=args.cpu_workers or 2, max_batch_size=args.max_batch,
                  window_ms=args.window_ms, sim_profile_ms=parse_profile(args.profile) if args.profile else None,
                  redis_args=tuple(args.redis_args.split()), bulk_shards=args.shards)
    return StackOptions(**{**values, **overrides})


def cmd_run(args: argparse.Namespace, images: list[bytes]) -> dict:
    if args.stack == "local":   # make run's own processes, started here on a private Redis
        # Without --cpu-workers, the pool make run starts (the Procfile's default), not the bench's.
        options = stack_options(args, cpu_workers=args.cpu_workers)
        stack = ProcfileStack(Path(tempfile.mkdtemp(prefix="bench-")), options).start()
        try:
            results = run_suite(args.name, stack.url, images, args, scope=stack.cpu_scope())
        finally:
            stack.stop()
        return {"results": results, "title": f"bench of make run's stack ({stack.options.describe()})"}
    shard_ports = tuple(int(port) for port in args.shard_ports.split(",") if port)
    scope = CpuScope(args.redis_port, shard_ports=shard_ports) if args.redis_port else None
    results = run_suite(args.name, args.url, images, args, scope=scope)
    return {"results": results, "title": f"bench of {args.url}"}


def cmd_compare(args: argparse.Namespace, images: list[bytes]) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="bench-"))
    results = []
    baseline = BaselineServer(workdir / "baseline", args.device).start()
    try:
        results += run_suite("baseline", baseline.url, images, args, open_loop=False, scope=baseline.cpu_scope())
    finally:
        baseline.stop()
    stack = LocalStack(workdir / "pipeline", stack_options(args)).start()
    try:
        results += run_suite("pipeline", stack.url, images, args, scope=stack.cpu_scope())
    finally:
        stack.stop()
    return {"results": results, "title": f"baseline vs pipeline ({stack.options.describe()})"}


def cmd_ceiling(args: argparse.Namespace, images: list[bytes]) -> dict:
    """Open-loop rates in turn; the highest one still served within the SLA."""
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="bench-")), stack_options(args)).start()
    try:
        results = [measure("pipeline", stack.url, images, "open", q, args.open_duration, scope=stack.cpu_scope())
                   for q in args.qps]
    finally:
        stack.stop()
    served = [r for r in results if meets_sla(r, args.sla_ms)]
    ceiling = max((r["offered_qps"] for r in served), default=None)
    return {"results": results, "title": f"ceiling at p95 <= {args.sla_ms:g} ms ({stack.options.describe()})",
            "ceiling_qps": ceiling, "summary": f"highest offered rate served at p95 <= {args.sla_ms:g} ms: "
                                               f"{ceiling if ceiling is not None else 'none'} QPS"}


def cmd_ab(args: argparse.Namespace, images: list[bytes]) -> int:
    from bench.ab import markdown as ab_markdown
    from bench.ab import run_ab, setting_overlay, worktree

    a_name = " ".join([f"A {args.base}", *args.base_set, *(["(Sentinel)"] if args.base_sentinel else [])])
    b_name = " ".join(["B " + (args.head or "this checkout"), *args.head_set,
                       *(["(Sentinel)"] if args.head_sentinel else [])])
    sides = {a_name: worktree(args.base), b_name: Path(args.head).resolve() if args.head else REPO_ROOT}
    options = stack_options(args, cpu_workers=args.cpu_workers)
    concurrency, duration = args.closed[0], args.closed_duration
    settings = {a_name: setting_overlay(args.base_set), b_name: setting_overlay(args.head_set)}
    outcome = run_ab(sides, options, images, concurrency, duration, args.rounds, upload=args.upload,
                     log=lambda line: print(f"  {line}", file=sys.stderr), settings=settings,
                     sentinel=frozenset(name for name, on in ((a_name, args.base_sentinel),
                                                              (b_name, args.head_sentinel)) if on),
                     one_call=args.calls == ["one"])
    text = ab_markdown(outcome, sides, options, concurrency, duration)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"{stamp}-ab.md").write_text(text + "\n")
    (args.out / f"{stamp}-ab.json").write_text(json.dumps({"sides": {k: str(v) for k, v in sides.items()},
                                                           "base": args.base, **outcome}, indent=2))
    print(text + f"\n\nFiles: {args.out / f'{stamp}-ab.json'}")
    return 0


def cmd_feed(args: argparse.Namespace) -> int:
    from bench.feed import FeedOptions, markdown, run_feed

    width, height = (int(v) for v in args.image_size.lower().split("x"))
    profiles = args.profile if args.device == "sim" else args.profile[:1]
    results = []
    for size in args.input_size:
        for profile in profiles:
            options = FeedOptions(device=args.device, profile=profile, frames=args.frames, input_size=size,
                                  source=args.source, image_size=(width, height), max_batch=args.max_batch,
                                  window_ms=args.window_ms, redis_check=not args.no_redis_check,
                                  py_spy=args.py_spy, model_options=dict(args.model_option),
                                  **({"model": args.model.resolve()} if args.model else {}))
            results.append(run_feed(options, log=lambda line: print(f"  {line}", file=sys.stderr)))
            print(f"  {args.device} {profile} {size}: {results[-1]['frames_per_s']:.0f} frames/s, "
                  f"{results[-1]['share_of_limit']:.0%} of the limit", file=sys.stderr)
    text = markdown(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"{stamp}-feed.md").write_text(text + "\n")
    (args.out / f"{stamp}-feed.json").write_text(json.dumps({"title": "bench feed", "results": results}, indent=2))
    print(text + f"\n\nFiles: {args.out / f'{stamp}-feed.json'}")
    return 0


def cmd_instructions(args: argparse.Namespace) -> int:
    from bench import instructions
    from bench.ab import worktree

    unknown = [role for role in args.role if role not in instructions.ROLES]
    if unknown:
        raise SystemExit(f"--role {','.join(unknown)}: expected some of {', '.join(instructions.ROLES)}")
    sides = {**({f"A {args.base}": worktree(args.base)} if args.base else {}), "this checkout": REPO_ROOT}
    images = load_corpus(None, count=4)
    counted: dict[str, list] = {}
    for role in args.role:
        for side, root in sides.items():
            counted.setdefault(side, []).append(instructions.count(role, root, images))
            print(f"  {side} {role}: {counted[side][-1].per_unit / 1e6:.2f} M instructions", file=sys.stderr)
    print(instructions.markdown(counted))
    return 0


def cmd_hostile(args: argparse.Namespace, images: list[bytes]) -> int:
    from bench.ab import worktree
    from bench.hostile_images import markdown as hostile_markdown
    from bench.hostile_images import run_hostile

    # make run's CPU pool (three children) unless told otherwise: the probe's stack.
    options = stack_options(args, cpu_workers=args.cpu_workers or 3)
    sides = {**({f"A {args.base}": worktree(args.base)} if args.base else {}), "this checkout": REPO_ROOT}
    texts, outcomes = [], {}
    for side, root in sides.items():
        outcomes[side] = run_hostile(replace(options, root=root), images, args.qps, args.quiet, args.duration,
                                     args.copies, log=lambda line: print(f"  {line}", file=sys.stderr))
        texts.append(hostile_markdown(side, outcomes[side]))
    text = "\n\n".join(texts)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"{stamp}-hostile.md").write_text(text + "\n")
    (args.out / f"{stamp}-hostile.json").write_text(json.dumps(outcomes, indent=2))
    print(text + f"\n\nFiles: {args.out / f'{stamp}-hostile.json'}")
    return 0


def parse_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as YAML (true, 16, fp16, [1, 2])."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)


def parse_list(kind):
    return lambda text: [kind(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--corpus", type=Path, help="a folder of images (default: generated 1080p JPEGs)")
    common.add_argument("--images", type=int, default=24, help="how many images to generate")
    common.add_argument("--out", type=Path, default=Path(".bench") / "results")
    common.add_argument("--closed", type=parse_list(int), default=[1, 8, 32], help="closed-loop concurrencies")
    common.add_argument("--closed-duration", type=float, default=20.0)
    common.add_argument("--open-qps", type=parse_list(float), default=[18.0], help="open-loop rates")
    common.add_argument("--open-duration", type=float, default=60.0)
    common.add_argument("--repeat-share", type=parse_list(float), default=[0.0],
                        help="closed loops: the share of requests that repeat an earlier image (e.g. 0,0.5,0.9: "
                             "each level at each share); the result cache answers repeats")
    common.add_argument("--calls", type=parse_list(str), default=["two"],
                        help="two: submit, then long-poll (the default); one: POST /v1/jobs?wait=30 answers the "
                             "finished job; one,two: both, in turn")
    common.add_argument("--upload", choices=load.UPLOADS, default="raw",
                        help="raw: the image as the body (Content-Type: image/jpeg); multipart: a form field "
                             "(curl -F)")
    local = argparse.ArgumentParser(add_help=False)
    local.add_argument("--device", default="sim", help="sim | cpu | cuda (for the stacks the bench starts)")
    local.add_argument("--cpu-workers", type=int, default=None,
                       help="CPU worker pool size (default 2; with --stack local, the Procfile's: 3)")
    local.add_argument("--max-batch", type=int, default=8)
    local.add_argument("--window-ms", type=float, default=12.0)
    local.add_argument("--redis-args", default="", help="more options for the stacks' redis-server, e.g. "
                                                         "'--io-threads 2 --io-threads-do-reads yes'")
    local.add_argument("--shards", type=int, default=0,
                       help="bulk shards: uploads and frames on this many more redis-servers (bulk.redis_urls), "
                            "each one's CPU per image reported (default 0: all in the one Redis)")
    local.add_argument("--profile", help="device sim: the latency profile of the stacks started here (fast, story "
                                         "or 1:2,8:6,16:10 ms per batch size; default: the config's, story)")

    run = sub.add_parser("run", parents=[common, local], help="load a running deployment, or make run's stack")
    run.add_argument("--url", default="http://localhost:8000")
    run.add_argument("--stack", choices=("local",),
                     help="local: start make run's processes (the Procfile under tools.procfile, Flower included) "
                          "on a private Redis, and load them")
    run.add_argument("--name", default="service")
    run.add_argument("--model", help="submit to this model (name, or name:version pinned); default: the "
                                     "deployment's default model")
    run.add_argument("--redis-port", type=int, default=6379,
                     help="the deployment's Redis port, for CPU per image by role (0: leave CPU out)")
    run.add_argument("--shard-ports", default="",
                     help="its bulk shards' Redis ports on this machine, comma-separated: each one's CPU per image")
    ab = sub.add_parser("ab", parents=[common, local], help="two builds of make run's stack, runs alternating")
    ab.add_argument("--base", required=True, help="the git ref measured as A (checked out under .bench/ab/)")
    ab.add_argument("--head", help="the checkout measured as B (default: this one)")
    ab.add_argument("--rounds", type=int, default=3, help="runs of each side")
    ab.add_argument("--base-sentinel", action="store_true",
                    help="side A behind Sentinel (a primary, two replicas, three Sentinels; 202s wait for a replica)")
    ab.add_argument("--head-sentinel", action="store_true", help="side B behind Sentinel")
    ab.add_argument("--base-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a setting of A's own (repeatable), e.g. cache.enabled=false with --base HEAD")
    ab.add_argument("--head-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a setting of B's own (repeatable)")
    sub.add_parser("compare", parents=[common, local], help="baseline vs pipeline, started here")
    ceiling = sub.add_parser("ceiling", parents=[common, local], help="highest rate within the SLA")
    ceiling.add_argument("--qps", type=parse_list(float), default=[24.0, 26.0, 28.0, 30.0])
    ceiling.add_argument("--sla-ms", type=float, default=800.0)
    diagnose_parser = sub.add_parser("diagnose", parents=[common], help="the story's checklist against a deployment")
    diagnose_parser.add_argument("--url", default="http://localhost:8000")
    tune_parser = sub.add_parser("tune", parents=[common, local], help="sweep workers x batch x window at a load")
    tune_parser.add_argument("--qps", type=float, default=18.0)
    tune_parser.add_argument("--sla-ms", type=float, default=800.0)
    tune_parser.add_argument("--workers", type=parse_list(int), default=[1, 2])
    tune_parser.add_argument("--batches", type=parse_list(int), default=[4, 8, 16])
    tune_parser.add_argument("--windows", type=parse_list(float), default=[6.0, 12.0, 24.0])
    tune_parser.add_argument("--write", type=Path, default=Path(".bench") / "tuned.yaml")
    bound = sub.add_parser("bound", help="the latency floor the device profile alone allows")
    bound.add_argument("--qps", type=parse_list(float), default=[10.0, 18.0, 26.0, 28.0, 30.0])
    bound.add_argument("--window-ms", type=float, default=12.0)
    bound.add_argument("--max-batch", type=int, default=8)
    nms = sub.add_parser("nms", help="post-processing's worst cases per batch (conf=0), on this machine's CPU")
    nms.add_argument("--batch", type=int, default=8)
    nms.add_argument("--max-candidates", type=int, default=1000)
    nms.add_argument("--max-det", type=parse_list(int), default=[100, 1000])
    chaos = sub.add_parser("chaos", parents=[common, local], help="load while killing workers and Redis")
    chaos.add_argument("--qps", type=float, default=8.0)
    chaos.add_argument("--duration", type=float, default=60.0)
    chaos.add_argument("--scenario", choices=("kills", "failover"), default="kills",
                       help="kills: workers and Redis killed and restarted; failover: make run's stack behind "
                            "Sentinel (REDIS=sentinel), the primary SIGKILLed, back later as a replica")
    chaos.add_argument("--kill-at", type=float, default=10.0, help="failover: seconds into the load")
    chaos.add_argument("--back-after", type=float, default=10.0,
                       help="failover: seconds from the kill until the killed server starts again")
    hostile = sub.add_parser("hostile", parents=[common, local], help="an attack on a local stack, and what a normal "
                                                                       "tenant saw meanwhile")
    hostile.add_argument("--attack", choices=("images", "slow-callbacks", "docs-flood", "metrics"), default="images",
                         help="images: issue 40's hostile image files (the normal tenant's queue_cpu); slow-callbacks: "
                              "one tenant's tarpit receivers (another's callbacks); docs-flood; metrics")
    hostile.add_argument("--duration", type=float, default=None, help="how long the attack lasts (s); default 30 "
                                                                       "for images, 60 otherwise; docs-flood: half "
                                                                       "alone, half with the flood")
    hostile.add_argument("--attackers", type=int, default=16, help="slow-callbacks: the attacker's jobs")
    hostile.add_argument("--interval", type=float, default=2.0,
                         help="slow-callbacks: the tarpit's seconds between two bytes")
    hostile.add_argument("--root", type=Path, help="run the stack from this checkout (e.g. the figures before a "
                                                   "change); default: this one")
    hostile.add_argument("--qps", type=float, default=4.0, help="images: the normal tenant's steady rate")
    hostile.add_argument("--quiet", type=float, default=15.0, help="images: seconds of the normal tenant alone first")
    hostile.add_argument("--copies", type=int, default=3, help="images: how many of each hostile file, sent at once")
    hostile.add_argument("--base", help="images: a git ref attacked first, the same way (checked out under .bench/ab/)")
    instructions = sub.add_parser("instructions", help="instructions per API request pair or CPU task (valgrind): "
                                                        "a figure this shared machine's drift does not move")
    instructions.add_argument("--role", type=parse_list(str), default=["api", "cpu-task"],
                              help="api (a submit and its long-poll), cpu-task (one preprocess task)")
    instructions.add_argument("--base", help="a git ref counted too, beside this checkout")
    feed = sub.add_parser("feed", help="the GPU worker alone, draining frames pushed in advance")
    feed.add_argument("--device", default="sim", help="sim | cpu | cuda | cuda:N")
    feed.add_argument("--profile", type=parse_list(str), default=["fast"],
                      help="sim latency profiles, each fast, story or 1:2,8:6,16:10 (ms per batch size)")
    feed.add_argument("--frames", type=int, default=1600, help="frames pushed in advance")
    feed.add_argument("--input-size", type=parse_list(int), default=[320], help="model input sizes, e.g. 320,640")
    feed.add_argument("--source", choices=("jpeg", "synthetic"), default="jpeg",
                      help="jpeg: the real CPU stage on generated JPEGs; synthetic: random content")
    feed.add_argument("--image-size", default="640x480", help="WxH of the images the frames come from")
    feed.add_argument("--max-batch", type=int, default=8)
    feed.add_argument("--window-ms", type=float, default=12.0)
    feed.add_argument("--model", type=Path, help="the model spec file (default: shapes-yolo)")
    feed.add_argument("--model-option", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
                      help="a spec field over the file's, e.g. accelerate=cuda_graphs or precision=fp16 (repeatable)")
    feed.add_argument("--no-redis-check", action="store_true", help="skip measuring Redis's own drain rate")
    feed.add_argument("--py-spy", type=Path, help="profile the worker with py-spy into this file (collapsed stacks)")
    feed.add_argument("--out", type=Path, default=Path(".bench") / "results")
    args = parser.parse_args(argv)

    if args.command == "feed":
        return cmd_feed(args)
    if args.command == "instructions":
        return cmd_instructions(args)
    if args.command == "bound":
        from bench.bound import describe
        from contract.config import load_settings
        print(describe(load_settings().gpu_worker.sim_latency_ms, args.qps, args.window_ms, args.max_batch))
        return 0
    if args.command == "nms":
        from bench.nms import describe as describe_nms
        print("\n\n".join(describe_nms(args.batch, args.max_candidates, max_det) for max_det in args.max_det))
        return 0
    images = load_corpus(args.corpus, count=args.images)
    if args.command == "diagnose":
        from bench.diagnose import diagnose
        print(diagnose(args.url, images))
        return 0
    if args.command == "ab":
        return cmd_ab(args, images)
    if args.command == "chaos" and args.scenario == "failover":
        from bench.failover import format_failover, run_failover
        tally = run_failover(stack_options(args, cpu_workers=args.cpu_workers), images, args.qps, args.duration,
                             args.kill_at, args.back_after, log=lambda line: print(f"  {line}", file=sys.stderr))
        print(format_failover(tally))
        return 0 if tally["lost"] == 0 and tally["restarted"] == 0 else 1
    if args.command == "chaos":
        from bench.chaos import format_tally, run_chaos
        tally = run_chaos(stack_options(args), images, args.qps, args.duration,
                          log=lambda line: print(f"  {line}", file=sys.stderr))
        print(format_tally(tally))
        return 0 if tally["lost"] == 0 and tally["duplicated"] == 0 else 1
    if args.command == "hostile":
        if args.attack == "images":
            if args.duration is None:
                args.duration = 30.0
            return cmd_hostile(args, images)
        from bench.hostile import ATTACKS
        attack, describe_outcome = ATTACKS[args.attack]
        options = stack_options(args, **({"root": args.root.resolve()} if args.root else {}))
        outcome = attack(options, images, attackers=args.attackers,
                         duration_s=args.duration if args.duration is not None else 60.0,
                         interval_s=args.interval, log=lambda line: print(f"  {line}", file=sys.stderr))
        print(describe_outcome(outcome))
        print(json.dumps(outcome))
        return 0
    if args.command == "tune":
        from bench.tune import tune
        outcome = tune(args, images)
    else:
        outcome = {"run": cmd_run, "compare": cmd_compare, "ceiling": cmd_ceiling}[args.command](args, images)
    results, title = outcome.pop("results"), outcome.pop("title")
    print(write_report(results, args.out, title, outcome))
    for line in (outcome.get("summary"), outcome.get("table")):
        if line:
            print("\n" + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
