"""The commands that load a stack while something goes wrong: workers and Redis killed, a Redis failover, an attack
(hostile images, slow callback receivers, a docs flood, metrics' labels), and what a normal tenant saw."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.commands.common import log_line, stack_options, write_files
from bench.stack.corpus import load_corpus
from bench.stack.processes import REPO_ROOT


def add_commands(
    sub: Any, common: argparse.ArgumentParser, local: argparse.ArgumentParser
) -> dict[str, Callable[[argparse.Namespace], int]]:
    chaos = sub.add_parser("chaos", parents=[common, local], help="load while killing workers and Redis")
    chaos.add_argument("--qps", type=float, default=8.0)
    chaos.add_argument("--duration", type=float, default=60.0)
    chaos.add_argument(
        "--scenario",
        default=None,
        help="kills (the default): workers and Redis killed and restarted; failover: make run's stack behind "
        "Sentinel (REDIS=sentinel), the primary SIGKILLed, back later as a replica. With --hosts: a partition, "
        "dead-host or clock scenario by name, or `all` (the list: --hosts --scenario list)",
    )
    chaos.add_argument(
        "--hosts",
        action="store_true",
        help="the service as several hosts (network namespaces: root, iptables), every client operation recorded "
        "and checked (bench.faults.partitions)",
    )
    chaos.add_argument("--runs", type=int, default=1, help="runs of each scenario (and of each --order)")
    chaos.add_argument("--fault-at", type=float, default=6.0, help="--hosts: seconds of load before the fault")
    chaos.add_argument("--fault-s", type=float, default=20.0, help="--hosts: how long the fault lasts")
    chaos.add_argument("--after", type=float, default=15.0, help="--hosts: seconds of load after the fault")
    chaos.add_argument("--deadline-ms", type=int, default=60_000, help="--hosts: every job's deadline_ms")
    chaos.add_argument("--root", type=Path, help="--hosts: run the service from this checkout (the figures before)")
    chaos.add_argument(
        "--from",
        dest="from_ref",
        default=None,
        help="upgrade: the git ref the stack starts at (a worktree under .bench/ab/); each role is then replaced "
        "by this checkout's (default: the last release, docs/releasing.md)",
    )
    chaos.add_argument(
        "--order", default="api-first", help="upgrade: api-first, workers-first, or both (each --runs times)"
    )
    chaos.add_argument("--kill-at", type=float, default=10.0, help="failover: seconds into the load")
    chaos.add_argument(
        "--back-after",
        type=float,
        default=10.0,
        help="failover: seconds from the kill until the killed server starts again",
    )
    hostile = sub.add_parser(
        "hostile", parents=[common, local], help="an attack on a local stack, and what a normal tenant saw meanwhile"
    )
    hostile.add_argument(
        "--attack",
        choices=(
            *("images", "cost", "decode", "slow-callbacks", "docs-flood", "metrics"),
            *("long-polls", "trickle", "redeliver", "leaks", "padding", "gpu-flood"),
        ),
        default="images",
        help="images: hostile image files through the stack (the normal tenant's queue_cpu, the CPU children's "
        "memory); cost: one key keeps --in-flight 16-bit Adam7 8192x8192 PNGs in flight (the other key's queue_cpu "
        "and refusals); decode: each file decoded in a fresh interpreter (CPU s, memory); slow-callbacks: one tenant's "
        "tarpit receivers (another's callbacks); docs-flood; metrics; long-polls: one key's held long-polls "
        "(/healthz, another key's submissions); trickle: one key's 20 MiB bodies held unfinished (the API's "
        "memory); redeliver: one key asking for a callback again and again; leaks: what /metrics, /v1/models and "
        "Flower tell a caller without the right key; padding: one key's JPEGs padded with 0-4 MiB of zeros from "
        "--attackers threads (another key's submissions, alone and beside them); gpu-flood: one key's 1x1 PNGs from "
        "--attackers threads (6) against another key's photo every 0.5 s (its latency, the flood's rate alone and "
        "beside it)",
    )
    hostile.add_argument(
        "--files",
        choices=("four", "five", "six", "all"),
        default="all",
        help="images, decode: issue 40's files (four), issue 52's (five), issue 59's PNG text (six) or all",
    )
    hostile.add_argument("--holds", type=int, default=4000, help="long-polls: the attacker's long-polls held at once")
    hostile.add_argument("--bodies", type=int, default=40, help="trickle: the attacker's bodies held at once")
    hostile.add_argument(
        "--ignore-retry-after",
        action="store_true",
        help="long-polls: the attacker sends each refused request again at once (a request flood, not a hold)",
    )
    hostile.add_argument(
        "--duration",
        type=float,
        default=None,
        help="how long the attack lasts (s); default 30 "
        "for images, 60 otherwise; docs-flood: half "
        "alone, half with the flood",
    )
    hostile.add_argument(
        "--attackers",
        type=int,
        default=None,
        help="slow-callbacks: the attacker's jobs (16); padding, gpu-flood: its threads (16, 6)",
    )
    hostile.add_argument(
        "--interval", type=float, default=2.0, help="slow-callbacks: the tarpit's seconds between two bytes"
    )
    hostile.add_argument(
        "--root",
        type=Path,
        help="run the stack from this checkout (e.g. the figures before a change); default: this one",
    )
    hostile.add_argument("--qps", type=float, default=4.0, help="images: the normal tenant's steady rate")
    hostile.add_argument("--quiet", type=float, default=15.0, help="images: seconds of the normal tenant alone first")
    hostile.add_argument("--copies", type=int, default=3, help="images: how many of each hostile file, sent at once")
    hostile.add_argument("--in-flight", type=int, default=3, help="cost: the attacker's expensive PNGs in flight")
    hostile.add_argument("--base", help="a git ref attacked first, the same way (checked out under .bench/ab/)")
    return {"chaos": cmd_chaos, "hostile": cmd_hostile}


def cmd_chaos(args: argparse.Namespace) -> int:
    """One harness (bench.faults.harness): the scenarios on one machine here, the --hosts ones in chaos_on_hosts."""
    from bench.faults.harness import RunOptions, format_verdict, run_scenario

    if args.scenario == "list" and not args.hosts:
        from bench.faults.partitions import scenarios

        local = {
            "kills": "make run's stack under load: the GPU worker killed twice, a Celery child once, Redis stopped",
            "failover": "make run's stack behind Sentinel: the primary SIGKILLed under load, back later as a replica",
            "cell-kill": "two cells behind one API: one cell's Redis SIGKILLed under load, back (its AOF) later",
            "cell-gpu-kill": "two cells behind one API: one cell's GPU worker SIGKILLed under load, back later",
            "cell-failover": "two cells each behind Sentinel, one API: one cell's primary SIGKILLed under load",
            "cell-cut": "two cells and the API on three hosts (root): one cell's host cut off from the API's, healed",
            "upgrade": "a rolling upgrade under load: the stack at --from (default: the last release), each role "
            "replaced by this checkout's in --order (api-first, workers-first, both)",
        }
        listed = {**local, **{f"--hosts {name}": s.description for name, s in scenarios().items()}}
        print("\n".join(f"{name}: {description}" for name, description in listed.items()))
        return 0
    if args.hosts:
        return chaos_on_hosts(args)
    images = load_corpus(args.corpus, count=args.images)
    name = args.scenario or "kills"
    if name == "kills":
        from bench.faults.kills import kills

        runs = [(kills(stack_options(args), args.duration), RunOptions(args.qps, 3.0, args.duration, 5.0))]
    elif name == "failover":
        from bench.faults.failover import failover

        after = max(0.0, args.duration - args.kill_at - args.back_after)
        run = RunOptions(args.qps, args.kill_at, 0.0, after)
        runs = [(failover(stack_options(args, cpu_workers=args.cpu_workers), args.back_after), run)]
    elif name == "cell-kill":
        from bench.faults.cell_kill import cell_kill

        after = max(0.0, args.duration - 5.0 - args.back_after)
        runs = [(cell_kill(stack_options(args), args.back_after), RunOptions(args.qps, 5.0, 0.0, after))]
    elif name in ("cell-gpu-kill", "cell-failover", "cell-cut"):
        runs = [_cell_fault(name, args)]
    elif name == "upgrade":
        from bench.faults.upgrade import ORDERS, last_release, upgrade

        orders = list(ORDERS) if args.order == "both" else args.order.split(",")
        if any(order not in ORDERS for order in orders):
            raise SystemExit(f"bench chaos --scenario upgrade: --order {args.order}: {', '.join(ORDERS)} or both")
        from_ref = args.from_ref or last_release()
        run = RunOptions(args.qps, 5.0, 0.0, 5.0)
        runs = [(upgrade(stack_options(args), from_ref, order), run) for order in orders]
    else:
        raise SystemExit(
            f"bench chaos: --scenario {name}: kills, failover, cell-kill, cell-gpu-kill, cell-failover, cell-cut, "
            "upgrade (or a --hosts one: list)"
        )
    verdicts = []
    for scenario, run in runs:
        for _ in range(args.runs):
            verdicts.append(run_scenario(scenario, images, run, log=log_line))
            print(format_verdict(verdicts[-1]), flush=True)
    print(f"Files: {write_files(args.out, f'chaos-{name}', '', verdicts)}")
    return 0 if all(v["ok"] for v in verdicts) else 1


def _cell_fault(name: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """cell-gpu-kill, cell-failover (bench.faults.cell_faults) or cell-cut (bench.faults.cell_cut): the fault 5 s
    into the load, the load on to --duration."""
    from bench.faults.cell_faults import cell_failover, cell_gpu_kill, gpu_kill_options
    from bench.faults.harness import RunOptions

    after = max(0.0, args.duration - 5.0 - args.back_after)
    if name == "cell-cut":
        from bench.faults.cell_cut import cell_cut

        return cell_cut(stack_options(args), args.back_after), RunOptions(args.qps, 5.0, 0.0, after)
    if name == "cell-gpu-kill":
        return cell_gpu_kill(gpu_kill_options(stack_options(args)), args.back_after), RunOptions(
            args.qps, 5.0, 0.0, after
        )
    return cell_failover(stack_options(args), args.back_after), RunOptions(args.qps, 5.0, 0.0, after)


def chaos_on_hosts(args: argparse.Namespace) -> int:
    """Each scenario `--runs` times on a fresh network: every verdict, then a table; non-zero if any broke."""
    from bench.faults.harness import RunOptions, format_verdict
    from bench.faults.partitions import hosted_options, run_scenario, scenarios, table

    known = scenarios()
    if args.scenario in (None, "list"):
        print("\n".join(f"{name}: {s.description}" for name, s in known.items()))
        return 0
    names = list(known) if args.scenario == "all" else args.scenario.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"bench chaos --hosts: no scenario {', '.join(unknown)} (--scenario list names them)")
    images = load_corpus(args.corpus, count=args.images)
    options = hosted_options(stack_options(args, **({"root": args.root.resolve()} if args.root else {})))
    run = RunOptions(
        qps=args.qps, fault_at_s=args.fault_at, fault_s=args.fault_s, after_s=args.after, deadline_ms=args.deadline_ms
    )
    verdicts = []
    for name in names:
        for _ in range(args.runs):
            verdicts.append(run_scenario(known[name], options, images, run, log=log_line))
            print(format_verdict(verdicts[-1]), flush=True)
    text = table(verdicts)
    print(text + f"\n\nFiles: {write_files(args.out, 'chaos-hosts', text, verdicts)}")
    return 0 if all(v["ok"] for v in verdicts) else 1


def cmd_hostile(args: argparse.Namespace) -> int:
    images = load_corpus(args.corpus, count=args.images)
    if args.attack in ("images", "cost"):
        return hostile_images(args, images, 30.0 if args.duration is None else args.duration)
    if args.attack == "decode":
        return hostile_decode(args)
    from bench.hostile import gpu, holds, padding, routes
    from bench.hostile.attacks import ATTACKS
    from bench.load.ab import worktree

    attacks: dict[str, tuple[Callable[..., dict[str, Any]], Callable[[dict[str, Any]], str]]] = {
        **ATTACKS,
        "long-polls": (holds.long_polls, holds.format_long_polls),
        "trickle": (holds.trickle, holds.format_trickle),
        "redeliver": (routes.redeliver, routes.format_redeliver),
        "leaks": (routes.leaks, routes.format_leaks),
        "padding": (padding.padding, padding.format_padding),
        "gpu-flood": (gpu.gpu_flood, gpu.format_gpu_flood),
    }
    attackers = args.attackers if args.attackers is not None else (6 if args.attack == "gpu-flood" else 16)
    attack, describe_outcome = attacks[args.attack]
    root = args.root.resolve() if args.root else REPO_ROOT
    sides = {**({f"A {args.base}": worktree(args.base)} if args.base else {}), "this checkout": root}
    outcomes = {}
    for side, side_root in sides.items():
        outcome = attack(
            replace(stack_options(args), root=side_root),
            images,
            attackers=attackers,
            holds=args.holds,
            bodies=args.bodies,
            honour_retry_after=not args.ignore_retry_after,
            **({"duration_s": args.duration} if args.duration is not None else {}),
            interval_s=args.interval,
            log=log_line,
        )
        outcomes[side] = outcome
        print(f"## {side}\n{describe_outcome(outcome)}")
    print(json.dumps(outcomes))
    return 0


def hostile_decode(args: argparse.Namespace) -> int:
    """Each hostile file decoded by each side's tasks.decoding.imaging in a fresh interpreter (no stack)."""
    from bench.hostile.images import ROUNDS, decode_each, decode_markdown
    from bench.load.ab import worktree

    sides = {**({f"A {args.base}": worktree(args.base)} if args.base else {}), "this checkout": REPO_ROOT}
    outcomes = {side: decode_each(root, ROUNDS[args.files]) for side, root in sides.items()}
    text = "\n\n".join(decode_markdown(side, rows) for side, rows in outcomes.items())
    print(text + f"\n\nFiles: {write_files(args.out, 'hostile-decode', text, outcomes)}")
    return 0


def hostile_images(args: argparse.Namespace, images: list[bytes], duration_s: float) -> int:
    """Issue 40's hostile image files against each side's stack, and what the normal tenant saw."""
    from bench.hostile import cost, files
    from bench.hostile.images import ROUNDS, run_hostile
    from bench.hostile.images import markdown as hostile_markdown
    from bench.load.ab import worktree

    # make run's CPU pool (three children) unless told otherwise: the probe's stack.
    options = stack_options(args, cpu_workers=args.cpu_workers or 3)
    this = ("this checkout", REPO_ROOT) if args.root is None else (str(args.root), args.root.resolve())
    sides = {**({f"A {args.base}": worktree(args.base)} if args.base else {}), this[0]: this[1]}
    texts, outcomes = [], {}
    expensive = files.png_rgba16_adam7() if args.attack == "cost" else b""
    for side, root in sides.items():
        keeper = cost.KeepInFlight(expensive, "image/png", args.in_flight, duration_s)
        outcomes[side] = run_hostile(
            replace(options, root=root),
            images,
            args.qps,
            args.quiet,
            duration_s,
            args.copies,
            attacks=ROUNDS[args.files] if args.attack == "images" else (),
            more_attacks=(keeper,) if args.attack == "cost" else (),
            log=log_line,
        )
        texts.append(hostile_markdown(side, outcomes[side]))
        if args.attack == "cost":
            keeper.join()
            outcomes[side]["attacker"] = keeper.tally()
            texts.append(cost.markdown(outcomes[side]))
    text = "\n\n".join(texts)
    print(text + f"\n\nFiles: {write_files(args.out, 'hostile', text, outcomes)}")
    return 0
