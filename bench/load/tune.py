"""`bench tune`: sweep CPU workers x max batch x window at a target load; pick
the configuration with the highest GPU busy % that still meets the p95 SLA
and the throughput target, and write it as a config file."""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.load.runs import measure, meets_sla
from bench.stack.local import LocalStack, StackOptions


def tune(args: argparse.Namespace, images: list[bytes]) -> dict[str, Any]:
    results, rows = [], []
    workdir = Path(tempfile.mkdtemp(prefix="tune-"))
    for i, (workers, batch, window) in enumerate(itertools.product(args.workers, args.batches, args.windows)):
        options = StackOptions(device=args.device, cpu_workers=workers, max_batch_size=batch, window_ms=window)
        stack = LocalStack(workdir / f"run{i}", options).start()
        try:
            result = measure(
                f"w{workers}-b{batch}-{window:g}ms",
                stack.url,
                images,
                "open",
                args.qps,
                args.open_duration,
                scope=stack.cpu_scope(),
            )
        finally:
            stack.stop()
        results.append(result)
        rows.append((options, result, meets_sla(result, args.sla_ms)))
    passing = [(o, r) for o, r, ok in rows if ok]
    chosen = max(passing, key=lambda pair: pair[1]["gpu_busy"] or 0.0) if passing else None
    table = _table(rows, chosen[0] if chosen else None)
    summary = (
        "no configuration met the SLA and the throughput target"
        if not chosen
        else f"chosen: {chosen[0].describe()} -> written to {args.write}"
    )
    if chosen:
        _write(args.write, chosen[0], chosen[1], args)
    return {
        "results": results,
        "title": f"tune at {args.qps:g} QPS, p95 <= {args.sla_ms:g} ms",
        "table": table,
        "summary": summary,
    }


def _table(rows: list, chosen: StackOptions | None) -> str:
    lines = [
        "| cpu workers | max batch | window ms | achieved QPS | p95 ms | GPU busy | meets SLA | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for options, r, ok in rows:
        busy = f"{r['gpu_busy']:.0%}" if r["gpu_busy"] is not None else "n/a"
        mark = "<- chosen" if options is chosen else ""
        lines.append(
            f"| {options.cpu_workers} | {options.max_batch_size} | {options.window_ms:g} | "
            f"{r['achieved_qps']:.2f} | {r['latency_ms']['p95']} | {busy} | {'yes' if ok else 'no'} "
            f"| {mark} |"
        )
    return "\n".join(lines)


def _write(path: Path, options: StackOptions, result: dict, args: argparse.Namespace) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Written by `bench tune` at {args.qps:g} QPS (p95 SLA {args.sla_ms:g} ms): achieved "
        f"{result['achieved_qps']:.2f} QPS, p95 {result['latency_ms']['p95']} ms, GPU busy "
        f"{(result['gpu_busy'] or 0):.0%}.\n# Run the CPU workers with --concurrency {options.cpu_workers} "
        f"(CPU_WORKERS={options.cpu_workers} make run). Use with IMGSERVE_CONFIG={path}.\n"
    )
    body = {"batching": {"max_batch_size": options.max_batch_size, "window_ms": options.window_ms}}
    path.write_text(header + yaml.safe_dump(body))
