"""Turning outcomes into figures: throughput, latency percentiles, failures,
batch sizes, GPU busy %, and the aggregated time bill."""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.load.client import Outcome
from bench.stack.cpu import ROLE_ORDER, SHARD_ROLE
from contract.jobs.timebill import STAGES, percentile, summarise_bills


def summarise(
    name: str,
    mode: str,
    outcomes: list[Outcome],
    offered_qps: float | None,
    concurrency: int | None,
    gpu_before: dict | None,
    gpu_after: dict | None,
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    span = (max(o.ended for o in outcomes) - min(o.started for o in outcomes)) if outcomes else 0.0
    latencies = sorted(o.latency_s * 1000.0 for o in ok)
    batches = {o.doc["batch"]["id"]: o.doc["batch"]["size"] for o in ok if o.doc and o.doc.get("batch")}
    sizes = list(batches.values())
    return {
        "name": name,
        "mode": mode,
        "offered_qps": round(offered_qps, 3) if offered_qps else None,
        "concurrency": concurrency,
        "requests": len(outcomes),
        "succeeded": len(ok),
        "achieved_qps": round(len(ok) / span, 3) if span else 0.0,
        "latency_ms": {f"p{q}": round(percentile(latencies, q), 1) if latencies else None for q in (50, 95, 99)},
        "failures": dict(Counter(f"{o.status}:{o.reason}" for o in outcomes if not o.ok)),
        "batch_size_mean": round(sum(sizes) / len(sizes), 3) if sizes else None,
        "batch_size_histogram": dict(sorted(Counter(sizes).items())),
        "gpu_busy": _busy(gpu_before, gpu_after),
        "simulated_device": bool(gpu_after and gpu_after.get("simulated")),
        "time_bill_ms": summarise_bills([o.doc["timings_ms"] for o in ok if o.doc and o.doc.get("timings_ms")]),
    }


def _busy(before: dict | None, after: dict | None) -> float | None:
    if not before or not after or after["wall"] <= before["wall"]:
        return None
    device = after["device_seconds"] - before["device_seconds"]
    return round(device / (after["wall"] - before["wall"]) / after.get("workers", 1), 4)


def markdown(results: list[dict[str, Any]], title: str = "bench") -> str:
    simulated = any(r["simulated_device"] for r in results)
    lines = [f"## {title}", ""]
    if simulated:
        lines += ["*Device: **simulated accelerator** (latency profile from config); everything else real.*", ""]
    lines += [
        "| run | mode | offered QPS | conc. | achieved QPS | p50 ms | p95 ms | p99 ms | failed | "
        "mean batch | GPU busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lat = r["latency_ms"]
        failed = sum(r["failures"].values())
        busy = f"{r['gpu_busy'] * 100:.0f}%" if r["gpu_busy"] is not None else "n/a"
        lines.append(
            f"| {r['name']} | {r['mode']} | {_fmt(r['offered_qps'])} | {_fmt(r['concurrency'])} | "
            f"{r['achieved_qps']:.2f} | {_fmt(lat['p50'])} | {_fmt(lat['p95'])} | {_fmt(lat['p99'])} | "
            f"{failed} | {_fmt(r['batch_size_mean'])} | {busy} |"
        )
    for r in results:
        if r["failures"]:
            lines += [
                "",
                f"Failures of {r['name']} {r['mode']}: " + ", ".join(f"{k} x{v}" for k, v in r["failures"].items()),
            ]
    lines += ["", "### Time bill (ms, over succeeded requests)", ""]
    stages = list(STAGES)
    lines += ["| run | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    for r in results:
        bill = r["time_bill_ms"]
        cells = [f"{bill[s]['p50']:.0f} / {bill[s]['p95']:.0f}" if s in bill else "-" for s in stages]
        lines.append(f"| {r['name']} {r['mode']} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: p50 / p95."]
    with_cpu = [r for r in results if r.get("cpu_ms_per_image")]
    if with_cpu:
        shards = sorted({role for r in with_cpu for role in r["cpu_ms_per_image"] if role.startswith(SHARD_ROLE)})
        roles = [
            role
            for role in (*ROLE_ORDER, "redis-main", *shards, "stack", "stack/bench")
            if any(role in r["cpu_ms_per_image"] for r in with_cpu)
        ]
        lines += [
            "",
            "### CPU per image (ms, per role, over the run; `stack`: all but the load generator; "
            "`stack/bench`: the stack in units of the load generator's own CPU per image, which does the "
            "same work in every run: compare builds by it on a machine whose speed drifts)",
            "",
            "| run | " + " | ".join(roles) + " | machine busy / stolen |",
            "|---|" + "---|" * (len(roles) + 1),
        ]
        for r in with_cpu:
            cells = [f"{r['cpu_ms_per_image'][role]:.1f}" if role in r["cpu_ms_per_image"] else "-" for role in roles]
            machine = r.get("machine_cpu")
            shares = f"{machine['busy']:.0%} / {machine['steal']:.0%}" if machine else "-"
            lines.append(f"| {_run_label(r)} | " + " | ".join(cells) + f" | {shares} |")
    with_floor = [r for r in with_cpu if r.get("floor")]
    if with_floor:
        lines += [
            "",
            "### Against the decode floor (one thread decoding, resizing and letterboxing the same images "
            "with Pillow-SIMD, measured right after the run; `stack`: every process, Redis included)",
            "",
            "| run | images/s | stack ms | floor ms | stack / floor | cores per 1,000 images/s | "
            "images/s per Redis core |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in with_floor:
            floor = r["floor"]
            cells = [
                f"{r['achieved_qps']:.1f}",
                _fmt(r["cpu_ms_per_image"].get("stack")),
                f"{floor['decode_floor_ms']:.2f}",
                f"{_fmt(floor.get('stack_over_floor'))}x",
                _fmt(floor.get("cores_per_1000_images_s")),
                _fmt(floor.get("images_s_per_redis_core")),
            ]
            lines.append(f"| {_run_label(r)} | " + " | ".join(cells) + " |")
    with_repeats = [r for r in results if r.get("repeat_share")]
    if with_repeats:
        lines += [
            "",
            "### The result cache (`--repeat-share`: a hit's cost derived against the same load without "
            "repeats; its answer and first poll as this client saw them, loopback included, and the poll "
            "as the API timed it)",
            "",
            "| run | repeats | hits | hit CPU ms | hit / miss | hit's 202 p50 / p95 ms | "
            "first poll p50 / p95 ms | at the API (Server-Timing) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in with_repeats:
            cost, answer = r.get("cache_hit_cost") or {}, r.get("cache_hit_ms") or {}
            poll, at_api = r.get("cache_hit_poll_ms") or {}, r.get("cache_hit_poll_api_ms") or {}
            cells = [
                f"{r['repeat_share']:.0%}",
                f"{r.get('cache_hits', 0)} of {r.get('succeeded', 0)}",
                _fmt(cost.get("hit_ms")),
                _fmt(cost.get("hit_over_miss")),
                f"{_fmt(answer.get('p50'))} / {_fmt(answer.get('p95'))}",
                f"{_fmt(poll.get('p50'))} / {_fmt(poll.get('p95'))}",
                f"{_fmt(at_api.get('p50'))} / {_fmt(at_api.get('p95'))}",
            ]
            lines.append(f"| {_run_label(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_label(r: dict[str, Any]) -> str:
    return f"{r['name']} {r['mode']} {_fmt(r['offered_qps'] or r['concurrency'])}"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
