"""`bench ab`: two builds of make run's stack, measured in turns on the same load.

    python -m bench ab --base HEAD~1 --closed 32 --closed-duration 30 --profile fast --rounds 3

The base is a git ref checked out (once) as a worktree under .bench/ab/; the other side is this checkout.
`--base-set` / `--head-set SECTION.KEY=VALUE` give one side settings of its own: with `--base HEAD`, one
build with a feature off against the same build with it on.
Runs alternate A B, B A, A B... so that a drift of this shared machine's speed falls on both sides alike;
each side's figures are the median of its runs. Every run is `measure` on a fresh ProcfileStack, with the
CPU per image of every role and the decode floor measured right after it.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from bench.load.client import closed_loop
from bench.load.runs import measure
from bench.stack.local import ProcfileStack, StackOptions
from bench.stack.processes import REPO_ROOT

WARM_UP_S = 5.0
FIGURES = (
    ("images/s", lambda r: r["achieved_qps"]),
    ("p95 ms", lambda r: r["latency_ms"]["p95"]),
    ("stack CPU ms/image", lambda r: r.get("cpu_ms_per_image", {}).get("stack")),
    ("API", lambda r: r.get("cpu_ms_per_image", {}).get("api")),
    ("CPU workers", lambda r: r.get("cpu_ms_per_image", {}).get("cpu-worker")),
    ("GPU worker", lambda r: r.get("cpu_ms_per_image", {}).get("gpu-worker")),
    ("Flower", lambda r: r.get("cpu_ms_per_image", {}).get("flower")),
    ("Redis", lambda r: r.get("cpu_ms_per_image", {}).get("redis")),
    ("Redis main thread", lambda r: r.get("cpu_ms_per_image", {}).get("redis-main")),
    ("Redis replicas", lambda r: r.get("cpu_ms_per_image", {}).get("redis-replica")),
    ("Sentinels", lambda r: r.get("cpu_ms_per_image", {}).get("redis-sentinel")),
    ("Redis commands/image", lambda r: r.get("redis_per_image", {}).get("commands")),
    ("replication KB/image", lambda r: r.get("redis_per_image", {}).get("repl_kb")),
    ("AOF rewrites (primary)", lambda r: r.get("redis_per_image", {}).get("aof_rewrites")),
    ("decode floor ms", lambda r: r.get("floor", {}).get("decode_floor_ms")),
    ("stack / floor", lambda r: r.get("floor", {}).get("stack_over_floor")),
)


def worktree(ref: str, parent: Path = REPO_ROOT / ".bench" / "ab") -> Path:
    """A checkout of `ref` (kept between runs: one per commit)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    path = parent / sha[:12]
    if not (path / "Procfile").exists():
        parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["git", "worktree", "add", "--force", "--detach", str(path), sha],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
        )
    return path


def setting_overlay(assignments: list[str]) -> dict[str, Any]:
    """`SECTION.KEY=VALUE` strings (the value read as YAML: false, 20, [a, b]) as a config overlay by section:
    one build measured with a setting and without (`--base HEAD --base-set cache.enabled=false`)."""
    overlay: dict[str, Any] = {}
    for assignment in assignments:
        name, equals, value = assignment.partition("=")
        section, dot, key = name.strip().partition(".")
        if not equals or not dot or not section or not key:
            raise ValueError(f"{assignment!r}: give SECTION.KEY=VALUE, e.g. cache.enabled=false")
        overlay.setdefault(section, {})[key] = yaml.safe_load(value)
    return overlay


def run_ab(
    sides: dict[str, Path],
    options: StackOptions,
    images: list[bytes],
    concurrency: int,
    duration_s: float,
    rounds: int,
    upload: str = "raw",
    log: Callable[[str], None] = lambda line: None,
    settings: dict[str, dict[str, Any]] | None = None,
    sentinel: frozenset[str] = frozenset(),
    one_call: bool = False,
    steady_qps: float | None = None,
) -> dict[str, Any]:
    """`rounds` runs of each side, alternating; {"runs": [...], "summary": {side: {figure: median}}}.
    `settings`: a side's own config overlay (setting_overlay), laid over `options.extra`. `sentinel`: the sides
    whose control plane is a Sentinel set (a primary, two replicas, three Sentinels; every 202 waits for a
    replica), their replicas' and Sentinels' CPU counted in the stack's; the other sides' plain Redis then
    keeps an append-only file as the Sentinel set's nodes do (and make run's and compose's Redis).
    `one_call`: each image in one call (POST ?wait=) instead of a submit and a long-poll. `steady_qps`: Poisson
    arrivals at that rate (an open loop) instead of `concurrency` clients in a closed loop: both sides then
    batch alike, where a closed loop's throughput (and so its batches) follows each side's speed."""
    names = list(sides)
    # Both sides' supervisors alone (launcher "procfile"): an older checkout has no .venv, and its run-local may
    # be one of the broken ones.
    side_options = {
        name: replace(
            options,
            root=path,
            launcher="procfile",
            sentinel=name in sentinel,
            control_plane_aof=bool(sentinel) and name not in sentinel,
            extra=_laid_over(options.extra, (settings or {}).get(name, {})),
        )
        for name, path in sides.items()
    }
    runs: list[dict[str, Any]] = []
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            stack = ProcfileStack(Path(tempfile.mkdtemp(prefix=f"ab-{names.index(name)}-")), side_options[name]).start()
            try:
                closed_loop(stack.url, images, concurrency, WARM_UP_S, upload=upload, one_call=one_call)
                result = measure(
                    name,
                    stack.url,
                    images,
                    "open" if steady_qps else "closed",
                    steady_qps or concurrency,
                    duration_s,
                    scope=stack.cpu_scope(),
                    upload=upload,
                    one_call=one_call,
                )
            finally:
                stack.stop()
            result["round"] = i + 1
            runs.append(result)
            log(
                f"round {i + 1} {name}: {result['achieved_qps']:.1f} images/s, "
                f"{result.get('floor', {}).get('stack_over_floor')}x the floor"
            )
    summary = {
        name: {label: _median([pick(r) for r in runs if r["name"] == name]) for label, pick in FIGURES}
        for name in names
    }
    return {"runs": runs, "summary": summary}


def _laid_over(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for section, value in overlay.items():
        both = isinstance(value, dict) and isinstance(merged.get(section), dict)
        merged[section] = {**merged[section], **value} if both else value
    return merged


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def markdown(
    outcome: dict[str, Any],
    sides: dict[str, Path],
    options: StackOptions,
    concurrency: int,
    duration_s: float,
    steady_qps: float | None = None,
) -> str:
    names = list(sides)
    upload = outcome["runs"][0].get("upload", "raw") if outcome["runs"] else "raw"
    lines = [
        "## bench ab: make run's stack, "
        + (f"Poisson arrivals at {steady_qps:g}/s" if steady_qps else f"{concurrency} clients in a closed loop")
        + f" ({upload} uploads), "
        f"{duration_s:g} s a run, runs alternating ({options.describe()})",
        "",
    ]
    lines += [f"- **{name}**: `{path}`" for name, path in sides.items()]
    lines += [
        "",
        "Medians of each side's runs:",
        "",
        "| figure | " + " | ".join(names) + f" | {names[1]} / {names[0]} |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    summary = outcome["summary"]
    for label, _ in FIGURES:
        a, b = summary[names[0]][label], summary[names[1]][label]
        ratio = f"{b / a:.2f}" if a and b is not None else "-"
        lines.append(f"| {label} | {_fmt(a)} | {_fmt(b)} | {ratio} |")
    lines += [
        "",
        "Each run:",
        "",
        "| round | side | " + " | ".join(label for label, _ in FIGURES) + " |",
        "|---|---|" + "---|" * len(FIGURES),
    ]
    for r in outcome["runs"]:
        lines.append(f"| {r['round']} | {r['name']} | " + " | ".join(_fmt(pick(r)) for _, pick in FIGURES) + " |")
    lines += ["", "The control plane's most-called commands per image (each side's last run):", ""]
    for name in names:
        last = next((r for r in reversed(outcome["runs"]) if r["name"] == name and r.get("redis_per_image")), None)
        if last:
            top = last["redis_per_image"]["top"]
            lines.append(f"- {name}: " + ", ".join(f"{command} {calls:g}" for command, calls in top.items()))
            if usec := last["redis_per_image"].get("usec"):  # absent in a report from before it was read
                lines.append("  - µs an image: " + ", ".join(f"{command} {us:g}" for command, us in usec.items()))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
