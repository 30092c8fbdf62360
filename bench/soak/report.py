"""`bench soak`'s report: as the terminal and the log files show it, and a saved one analysed again."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.soak.analysis import PASSING, Request, Sample, SoakOptions, analyse


def reanalyse(saved: dict[str, Any], window_s: float | None = None) -> dict[str, Any]:
    """A report written by `write`, analysed again from its samples (and its requests, where it kept them): the
    figures of a run under this checkout's rules (and its p95 per window of `window_s`, where given)."""
    fields = {name: value for name, value in saved["options"].items() if name in SoakOptions.__dataclass_fields__}
    if window_s:
        fields["window_s"] = window_s
    options = SoakOptions(**fields)
    samples = [
        Sample(**{**s, "processes": {int(pid): tuple(v) for pid, v in s["processes"].items()}})
        for s in saved["samples"]
    ]
    requests = [Request(*r) for r in saved.get("requests_log", [])]
    redis_part = saved.get("redis") or {}
    report = analyse(samples, requests, options, redis_part.get("ttl_s", {}), redis_part.get("key_bytes"))
    if "requests_log" not in saved:  # written before reports kept their requests: their figures as they were
        report["requests"], report["p95_windows"] = saved["requests"], saved["p95_windows"]
        report["passed"] = (
            all(r["verdict"] in PASSING for r in report["roles"].values())
            and not report["requests"]["lost"]
            and not report["requests"]["failed"]
            and not report["restarts"]
        )
    report["stack"] = saved.get("stack", "")
    report["samples"] = saved["samples"]
    return report


def markdown(report: dict[str, Any]) -> str:
    """The report as the terminal shows it."""
    options = report["options"]
    burst = f", then a burst at {options['burst_qps']:g} QPS" if options["burst_qps"] else ""
    lines = [
        f"# Soak: {options['minutes']:g} min at {options['qps']:g} QPS ({options['warmup_minutes']:g} min "
        f"warm-up not fitted){burst}",
        "",
        f"Stack: make run's processes, {report.get('stack', '')}",
        "",
        "## RSS by role (MB; slope by least squares over the steady load after the warm-up)",
        "",
        "| role | procs | first | last | slope MB/min (sum) | worst process: slope; first, last third | bound "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for role, r in report["roles"].items():
        worst = r["worst"] or {}
        bound = f"{r['bound_mb_min']:g}" + (f", <= {r['ceiling_mb']:g} MB" if r["ceiling_mb"] else "")
        lines.append(
            f"| {role} | {r['processes']} | {r['rss_first_mb']} | {r['rss_last_mb']} | "
            f"{_fmt(r['rss_slope_mb_min'])} | {_fmt(worst.get('slope_mb_min'))}; "
            f"{_fmt(worst.get('first_third_mb_min'))}, {_fmt(worst.get('last_third_mb_min'))} "
            f"(pid {worst.get('pid')}, {worst.get('first_mb')} -> {worst.get('last_mb')}) | {bound} | "
            f"{r['verdict']} |"
        )
    lines += [
        "",
        "## Descriptors and threads (summed over each role's processes)",
        "",
        "| role | fds first -> last | threads first -> last | fds before burst -> peak -> after | "
        "threads before -> after | RSS MB before burst -> after |",
        "|---|---|---|---|---|---|",
    ]
    for role, r in report["roles"].items():
        burst = (
            (
                f"{r['fds_before_burst']} -> {r['fds_burst_peak']} -> {r['fds_after_burst']} | "
                f"{r['threads_before_burst']} -> {r['threads_after_burst']} | "
                f"{r['rss_before_burst_mb']} -> {r['rss_after_burst_mb']}"
            )
            if "fds_after_burst" in r
            else "- | - | -"
        )
        lines.append(
            f"| {role} | {r.get('fds_first')} -> {r.get('fds_last')} | "
            f"{r.get('threads_first')} -> {r.get('threads_last')} | {burst} |"
        )
    redis_part = report.get("redis") or {}
    if redis_part:
        lines += [
            "",
            "## Redis",
            "",
            f"- used_memory {redis_part['start_mb']} MB, {redis_part['start_keys']} keys at the start -> "
            f"{redis_part['last_mb']} MB, {redis_part['last_keys']} keys at the end of the steady load -> "
            f"{redis_part['end_mb']} MB, {redis_part['end_keys']} keys at the end",
            f"- the TTLs predict {redis_part['predicted_keys']} keys once every key has lived its TTL "
            f"({options['qps']:g}/s x ttl x {redis_part['keys_per_job']} keys per job; TTLs "
            f"{', '.join(f'{k} {v:g} s' for k, v in redis_part['ttl_s'].items())})"
            + (
                f", ~{redis_part['predicted_mb']} MB at the {redis_part['bytes_per_key']} bytes per key measured"
                if redis_part.get("predicted_mb")
                else ""
            ),
            "- Redis's own count (MEMORY USAGE), bytes: "
            + (", ".join(f"{k} {v:g}" for k, v in redis_part.get("key_bytes", {}).items()) or "-"),
            f"- over the last half of the steady load: {_fmt(redis_part['keys_slope_last_half_per_min'])} "
            f"keys/min, {_fmt(redis_part['mb_slope_last_half_per_min'])} MB/min "
            + (
                "(the run outlasted the TTLs: this is the steady state)"
                if redis_part["ran_past_ttl"]
                else f"(the TTLs are longer than the run: it levels off after {redis_part['levels_off_after_s']:g} s)"
            ),
        ]
    lines += [
        "",
        "## p95 per window (succeeded requests, by when they were sent)",
        "",
        "| from s | to s | jobs | p50 ms | p95 ms (its sampling band) | p95 / first window's "
        "| stage moved most (p95) | cores: stack, bench, others |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in report["p95_windows"]:
        band = w.get("p95_band_ms")
        lines.append(
            f"| {w['from_s']} | {w['to_s']} | {w['jobs']} | {w['p50_ms']} | {w['p95_ms']}"
            + (f" ({band[0]}-{band[1]})" if band else "")
            + f" | {w['vs_first']} | {w.get('moved_most') or '-'} "
            f"| {w.get('stack_cores', '-')}, {w.get('bench_cores', '-')}, {w.get('other_cores', '-')} |"
        )
    if report["p95_windows"]:
        worst = max(report["p95_windows"], key=lambda w: w["vs_first"] or 0.0)
        lines += [
            "",
            f"p95 within 10% of the first window's in every window: "
            f"{'yes' if all((w['vs_first'] or 0.0) <= 1.10 for w in report['p95_windows']) else 'no'} "
            f"(the worst {worst['vs_first']}x, from {worst['from_s']} s).",
        ]
    requests = report["requests"]
    lines += ["", "## Requests and restarts", ""]
    for phase, tally in requests["by_phase"].items():
        lines.append(
            f"- {phase}: {tally['sent']} sent, {tally['succeeded']} succeeded, {tally['refused']} refused "
            f"(429/503), {tally['other']} other"
        )
    lines.append(
        f"- lost (accepted, not succeeded): {requests['lost']} {requests['lost_reasons'] or ''}; "
        f"failed submits: {requests['failed']}"
    )
    lines.append(f"- processes gone during the run (restarted): {report['restarts'] or 'none'}")
    lines += ["", "**PASSED**" if report["passed"] else "**FAILED**: " + "; ".join(_failures(report))]
    return "\n".join(lines)


def _failures(report: dict[str, Any]) -> list[str]:
    found = [
        f"{role} {r['verdict']} (worst {r['worst']['slope_mb_min'] if r['worst'] else '?'} MB/min, bound "
        f"{r['bound_mb_min']:g})"
        for role, r in report["roles"].items()
        if r["verdict"] not in PASSING
    ]
    if report["requests"]["lost"]:
        found.append(f"{report['requests']['lost']} jobs lost")
    if report["requests"]["failed"]:
        found.append(f"{report['requests']['failed']} submits failed")
    if report["restarts"]:
        found.append(f"restarts {report['restarts']}")
    return found


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}" if isinstance(value, float) else str(value)


def write(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y%m%d-%H%M%S')}-soak.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    (path.with_suffix(".md")).write_text(markdown(report) + "\n")
    return path
