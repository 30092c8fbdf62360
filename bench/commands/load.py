"""The load commands: a deployment, or stacks started here, under load, and the report of where the time went."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.commands.common import (
    log_line,
    parse_list,
    print_report,
    stack_options,
    write_files,
)
from bench.load.runs import hit_cost, measure, meets_sla
from bench.stack.corpus import load_corpus
from bench.stack.cpu import CpuScope
from bench.stack.local import BaselineServer, LocalStack, ProcfileStack
from bench.stack.processes import REPO_ROOT
from bench.stack.profiles import parse_profile


def add_commands(
    sub: Any, common: argparse.ArgumentParser, local: argparse.ArgumentParser
) -> dict[str, Callable[[argparse.Namespace], int]]:
    run = sub.add_parser("run", parents=[common, local], help="load a running deployment, or make run's stack")
    run.add_argument("--url", default="http://localhost:8000")
    run.add_argument(
        "--stack",
        choices=("local",),
        help="local: start make run's processes (the Procfile under tools.procfile, Flower included) "
        "on a private Redis, and load them",
    )
    run.add_argument("--name", default="service")
    run.add_argument(
        "--model", help="submit to this model (name, or name:version pinned); default: the deployment's default model"
    )
    run.add_argument(
        "--redis-port",
        type=int,
        default=6379,
        help="the deployment's Redis port, for CPU per image by role (0: leave CPU out)",
    )
    run.add_argument(
        "--shard-ports",
        default="",
        help="its bulk shards' Redis ports on this machine, comma-separated: each one's CPU per image",
    )
    ab = sub.add_parser("ab", parents=[common, local], help="two builds of make run's stack, runs alternating")
    ab.add_argument("--base", required=True, help="the git ref measured as A (checked out under .bench/ab/)")
    ab.add_argument("--head", help="the checkout measured as B (default: this one)")
    ab.add_argument("--rounds", type=int, default=3, help="runs of each side")
    ab.add_argument(
        "--base-sentinel",
        action="store_true",
        help="side A behind Sentinel (a primary, two replicas, three Sentinels; 202s wait for a replica)",
    )
    ab.add_argument("--head-sentinel", action="store_true", help="side B behind Sentinel")
    ab.add_argument(
        "--steady",
        type=float,
        metavar="QPS",
        help="Poisson arrivals at this rate for --closed-duration, instead of the closed loop: both sides batch "
        "alike (a closed loop's batches follow each side's speed)",
    )
    ab.add_argument(
        "--base-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a setting of A's own (repeatable), e.g. cache.enabled=false with --base HEAD",
    )
    ab.add_argument(
        "--head-set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a setting of B's own (repeatable)"
    )
    sub.add_parser("compare", parents=[common, local], help="baseline vs pipeline, started here")
    ceiling = sub.add_parser("ceiling", parents=[common, local], help="highest rate within the SLA")
    ceiling.add_argument("--qps", type=parse_list(float), default=[24.0, 26.0, 28.0, 30.0])
    ceiling.add_argument("--sla-ms", type=float, default=800.0)
    diagnose_parser = sub.add_parser(
        "diagnose",
        parents=[common],
        help="the story's checklist against a deployment: reads only, unless --load",
    )
    diagnose_parser.add_argument("--url", default="http://localhost:8000")
    diagnose_parser.add_argument(
        "--load",
        action="store_true",
        help="after the reads, add the story's sweep (--closed clients, 10 s each, of --corpus): load on the "
        "deployment, which its /v1/stats then counts as its own",
    )
    diagnose_parser.add_argument(
        "--redis-url",
        help="the deployment's Redis (redis://[:password@]host:port/db): its own counters (INFO, read-only) give "
        "what it spends an image; without it that figure is unknown",
    )
    diagnose_parser.add_argument("--read-s", type=float, default=5.0, help="seconds of reading the live figures")
    diagnose_parser.add_argument(
        "--api-key",
        default=os.environ.get("IMGSERVE_API_KEY"),
        help="an admin key, where the deployment has API keys (/v1/stats and /metrics need one); "
        "default: IMGSERVE_API_KEY",
    )
    tune_parser = sub.add_parser("tune", parents=[common, local], help="sweep workers x batch x window at a load")
    tune_parser.add_argument("--qps", type=float, default=18.0)
    tune_parser.add_argument("--sla-ms", type=float, default=800.0)
    tune_parser.add_argument("--workers", type=parse_list(int), default=[1, 2])
    tune_parser.add_argument("--batches", type=parse_list(int), default=[4, 8, 16])
    tune_parser.add_argument("--windows", type=parse_list(float), default=[6.0, 12.0, 24.0])
    tune_parser.add_argument("--write", type=Path, default=Path(".bench") / "tuned.yaml")
    peer = sub.add_parser(
        "peer",
        parents=[common, local],
        help="issue 43's synchronous peer (LitServe, `make peer`) and make run's stack, runs alternating "
        "(--profile: both sides', fast unless given; --calls one,two for both of ours)",
    )
    peer.add_argument("--rounds", type=int, default=2, help="a peer run, then one of ours per --calls, this often")
    _add_soak(sub)
    return {
        "run": cmd_run,
        "ab": cmd_ab,
        "compare": cmd_compare,
        "ceiling": cmd_ceiling,
        "diagnose": cmd_diagnose,
        "tune": cmd_tune,
        "soak": cmd_soak,
        "peer": cmd_peer,
    }


def _add_soak(sub: Any) -> None:
    soak = sub.add_parser(
        "soak",
        help="make run's stack under a steady load for long: each role's RSS slope, "
        "descriptors, threads, Redis against its TTLs, p95 per window",
    )
    soak.add_argument("--minutes", type=float, default=30.0, help="the steady load, warm-up included")
    soak.add_argument("--qps", type=float, default=15.0, help="Poisson arrivals per second (the story's peak: 15)")
    soak.add_argument("--warmup-minutes", type=float, default=2.0, help="the first minutes: sampled, not fitted")
    soak.add_argument("--sample-s", type=float, default=15.0, help="seconds between samples of every process")
    soak.add_argument(
        "--window-s", type=float, default=None, help="p95 per window of this many seconds (120; with --report: again)"
    )
    soak.add_argument(
        "--burst-qps",
        type=float,
        default=0.0,
        help="after the steady load: --idle-s idle, --burst-s at this rate, --idle-s idle (0: none)",
    )
    soak.add_argument("--burst-s", type=float, default=60.0)
    soak.add_argument("--idle-s", type=float, default=90.0)
    soak.add_argument(
        "--max-slope-mb-min",
        metavar="[ROLE=]MB",
        help="the RSS slope a process may have, e.g. 0.2 (every role) or gpu-worker=0.05,api=0.2 "
        "(default: 0.1 for each role; bench/soak/analysis.py ROLE_BOUNDS)",
    )
    soak.add_argument(
        "--max-rss-mb",
        metavar="ROLE=MB",
        help="a role allowed to grow, then level off under this RSS per process "
        "(default: flower=160; bench/soak/analysis.py ROLE_CEILINGS_MB)",
    )
    soak.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a setting of the stack's (repeatable), e.g. jobs.ttl_s=60 cache.ttl_s=60",
    )
    soak.add_argument("--profile", help="the sim device's latency profile (default: the config's, story)")
    soak.add_argument("--cpu-workers", type=int, default=None, help="default: the Procfile's")
    soak.add_argument("--corpus", type=Path, help="a folder of images (default: generated 1080p JPEGs)")
    soak.add_argument("--images", type=int, default=24, help="how many images to generate")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--out", type=Path, default=Path(".bench") / "results")
    soak.add_argument(
        "--report",
        type=Path,
        metavar="FILE.json",
        help="start nothing: analyse a soak's saved report again (its samples) and print it",
    )


def cmd_soak(args: argparse.Namespace) -> int:
    """make run's stack for long (bench.soak.run): each role's RSS slope, descriptors, threads, Redis, p95."""
    from bench.soak.run import main_soak

    return main_soak(args, [] if args.report else load_corpus(args.corpus, count=args.images))


def run_suite(
    name: str,
    url: str,
    images: list[bytes],
    args: argparse.Namespace,
    open_loop: bool = True,
    scope: CpuScope | None = CpuScope(),
) -> list[dict[str, Any]]:
    model = getattr(args, "model", None)
    upload = getattr(args, "upload", "raw")
    shares = getattr(args, "repeat_share", None) or [0.0]
    calls = getattr(args, "calls", None) or ["two"]
    results = [
        measure(
            name,
            url,
            images,
            "closed",
            c,
            args.closed_duration,
            scope=scope,
            model=model,
            upload=upload,
            repeat_share=share,
            one_call=call == "one",
        )
        for c in args.closed
        for share in shares
        for call in calls
    ]
    for result in results:  # each share's hit cost, against the same load without repeats
        plain = next(
            (
                r
                for r in results
                if r["concurrency"] == result["concurrency"] and not r["repeat_share"] and r["calls"] == result["calls"]
            ),
            None,
        )
        if result["repeat_share"] and plain is not None:
            result["cache_hit_cost"] = hit_cost(plain, result)
            print(f"  repeats {result['repeat_share']:.0%}: {result['cache_hit_cost']}", file=sys.stderr)
    if open_loop:
        results += [
            measure(name, url, images, "open", q, args.open_duration, scope=scope, model=model, upload=upload)
            for q in args.open_qps
        ]
    return results


def cmd_run(args: argparse.Namespace) -> int:
    images = load_corpus(args.corpus, count=args.images)
    if args.stack == "local":  # make run's own processes, started here on a private Redis
        # Without --cpu-workers, the pool make run starts (the Procfile's default), not the bench's.
        options = stack_options(args, cpu_workers=args.cpu_workers)
        stack = ProcfileStack(Path(tempfile.mkdtemp(prefix="bench-")), options).start()
        try:
            results = run_suite(args.name, stack.url, images, args, scope=stack.cpu_scope())
        finally:
            stack.stop()
        return print_report(
            {"results": results, "title": f"bench of make run's stack ({stack.options.describe()})"}, args.out
        )
    shard_ports = tuple(int(port) for port in args.shard_ports.split(",") if port)
    scope = CpuScope(args.redis_port, shard_ports=shard_ports) if args.redis_port else None
    results = run_suite(args.name, args.url, images, args, scope=scope)
    return print_report({"results": results, "title": f"bench of {args.url}"}, args.out)


def cmd_compare(args: argparse.Namespace) -> int:
    images = load_corpus(args.corpus, count=args.images)
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
    return print_report({"results": results, "title": f"baseline vs pipeline ({stack.options.describe()})"}, args.out)


def cmd_ceiling(args: argparse.Namespace) -> int:
    """Open-loop rates in turn; the highest one still served within the SLA."""
    images = load_corpus(args.corpus, count=args.images)
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="bench-")), stack_options(args)).start()
    try:
        results = [
            measure("pipeline", stack.url, images, "open", q, args.open_duration, scope=stack.cpu_scope())
            for q in args.qps
        ]
    finally:
        stack.stop()
    served = [r for r in results if meets_sla(r, args.sla_ms)]
    ceiling = max((r["offered_qps"] for r in served), default=None)
    summary = (
        f"highest offered rate served at p95 <= {args.sla_ms:g} ms: {ceiling if ceiling is not None else 'none'} QPS"
    )
    title = f"ceiling at p95 <= {args.sla_ms:g} ms ({stack.options.describe()})"
    return print_report({"results": results, "title": title, "ceiling_qps": ceiling, "summary": summary}, args.out)


def cmd_tune(args: argparse.Namespace) -> int:
    from bench.load.tune import tune

    return print_report(tune(args, load_corpus(args.corpus, count=args.images)), args.out)


def cmd_diagnose(args: argparse.Namespace) -> int:
    from bench.load.diagnose import diagnose

    print(
        diagnose(
            args.url,
            load_corpus(args.corpus, count=args.images),
            sweep=tuple(args.closed),
            load=args.load,
            redis_url=args.redis_url,
            read_s=args.read_s,
            api_key=args.api_key,
        )
    )
    return 0


def cmd_ab(args: argparse.Namespace) -> int:
    from bench.load.ab import markdown as ab_markdown
    from bench.load.ab import run_ab, setting_overlay, worktree

    images = load_corpus(args.corpus, count=args.images)
    a_name = " ".join([f"A {args.base}", *args.base_set, *(["(Sentinel)"] if args.base_sentinel else [])])
    b_name = " ".join(
        ["B " + (args.head or "this checkout"), *args.head_set, *(["(Sentinel)"] if args.head_sentinel else [])]
    )
    sides = {a_name: worktree(args.base), b_name: Path(args.head).resolve() if args.head else REPO_ROOT}
    options = stack_options(args, cpu_workers=args.cpu_workers)
    concurrency, duration = args.closed[0], args.closed_duration
    settings = {a_name: setting_overlay(args.base_set), b_name: setting_overlay(args.head_set)}
    outcome = run_ab(
        sides,
        options,
        images,
        concurrency,
        duration,
        args.rounds,
        upload=args.upload,
        log=log_line,
        settings=settings,
        sentinel=frozenset(name for name, on in ((a_name, args.base_sentinel), (b_name, args.head_sentinel)) if on),
        one_call=args.calls == ["one"],
        steady_qps=args.steady,
    )
    text = ab_markdown(outcome, sides, options, concurrency, duration, args.steady)
    written = write_files(
        args.out, "ab", text, {"sides": {k: str(v) for k, v in sides.items()}, "base": args.base, **outcome}
    )
    print(text + f"\n\nFiles: {written}")
    return 0


def cmd_peer(args: argparse.Namespace) -> int:
    from bench.load.peer import require_litserve, run_rounds

    require_litserve()  # before make run's stack is started for nothing
    images = load_corpus(args.corpus, count=args.images)
    profile = args.profile or "fast"  # both sides on one device profile: the peer sleeps it too
    options = stack_options(args, cpu_workers=args.cpu_workers, sim_profile_ms=parse_profile(profile))
    workdir = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    stack = ProcfileStack(workdir, options).start()
    try:
        outcome = run_rounds(
            stack,
            workdir,
            images,
            args.closed[0],
            args.closed_duration,
            args.rounds,
            args.calls,
            profile,
            args.upload,
        )
    finally:
        stack.stop()
    shutil.rmtree(workdir, ignore_errors=True)  # its logs are kept only when a run failed (the exception above)
    return print_report(
        {**outcome, "title": f"issue 43's peer and make run's stack, alternating ({stack.options.describe()})"},
        args.out,
    )
