"""`bench soak`'s p95 per window of the steady load: each window's band from its own sampling, each stage's p95
from the jobs' time bills and the one that moved most, and the cores the stack, the bench and the machine's other
processes used meanwhile (bench.soak.analysis puts them in the report)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from bench.soak.records import Request, Sample
from bench.stack import cpu
from contract.jobs.timebill import STAGES, percentile


def p95_windows(
    requests: list[Request], samples: list[Sample], warmup_s: float, end_s: float, window_s: float
) -> list[dict[str, Any]]:
    """p95 of the requests that succeeded, per window of the steady load (by when they were sent), with the band
    its own sampling puts around it (a p95 of ~1,800 requests moves several % by chance alone), each stage's p95
    from the jobs' time bills (which stage moved, where a window's p95 did), and the cores the stack, this load
    generator and the machine's other processes used meanwhile (on a shared machine a neighbour's hour shows in
    the p95: this says when)."""
    steady = [r for r in requests if r.phase == "steady" and r.status == "succeeded"]
    windows: list[dict[str, Any]] = []
    start, end = warmup_s, end_s
    while start < end - 1e-9:
        stop = min(end, start + window_s)
        inside = [r for r in steady if start <= r.started < stop]
        taken = sorted(r.seconds * 1000.0 for r in inside)
        if taken:
            windows.append(
                {
                    "from_s": round(start),
                    "to_s": round(stop),
                    "jobs": len(taken),
                    "p50_ms": round(percentile(taken, 50)),
                    "p95_ms": round(percentile(taken, 95)),
                    "p95_band_ms": p95_band(taken),
                    "stages_p95_ms": _stages_p95(inside),
                    **_cores(samples, start, stop),
                }
            )
        start = stop
    if windows:
        first = windows[0]["p95_ms"]
        for window in windows:
            window["vs_first"] = round(window["p95_ms"] / first, 3) if first else None
            if window is not windows[0]:
                window["moved_most"] = _moved_most(windows[0]["stages_p95_ms"], window["stages_p95_ms"])
    return windows


def p95_band(taken: list[float], resamples: int = 400, seed: int = 0) -> list[int]:
    """The 5th and 95th percentiles of the p95 over bootstrap resamples of `taken`: where this window's p95
    would fall by chance alone, had the service not changed at all."""
    values = np.asarray(taken)
    draws = np.random.default_rng(seed).choice(values, size=(resamples, len(values)), replace=True)
    p95s = np.percentile(draws, 95, axis=1)
    return [round(float(np.percentile(p95s, 5))), round(float(np.percentile(p95s, 95)))]


def _stages_p95(requests: list[Request]) -> dict[str, float]:
    """Each stage's p95 over these requests' time bills, and `deliver`: the client's latency past the bill's
    total (the long-poll's wake-up and the answer's way back)."""
    bills = [dict(r.bill, deliver=max(0.0, r.seconds * 1000.0 - r.bill["total"])) for r in requests if r.bill]
    bills = [b for b in bills if "total" in b]
    stages = [stage for stage in (*STAGES, "deliver") if any(stage in b for b in bills)]
    return {stage: round(percentile(sorted(b[stage] for b in bills if stage in b), 95), 1) for stage in stages}


def _moved_most(first: dict[str, float], window: dict[str, float]) -> str | None:
    """The stage (not the total) whose p95 moved most against the first window's, as `stage a -> b ms`."""
    moves = [(abs(window[s] - first[s]), s) for s in window if s in first and s != "total"]
    if not moves:
        return None
    _, stage = max(moves)
    return f"{stage} {first[stage]:g} -> {window[stage]:g} ms"


def _cores(samples: list[Sample], start: float, stop: float) -> dict[str, float]:
    """Cores used between the samples nearest `start` and `stop`: by the stack, the bench, everything else."""
    inside = [s for s in samples if start - 1e-6 <= s.t <= stop + 1e-6]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    seconds = last.t - first.t
    shares = cpu.cpu_shares(first.machine, last.machine)
    if seconds <= 0 or shares is None:
        return {}
    machine = shares["busy"] * (os.cpu_count() or 1)
    stack = (last.stack_cpu_s - first.stack_cpu_s) / seconds
    bench = (last.bench_cpu_s - first.bench_cpu_s) / seconds
    return {
        "stack_cores": round(stack, 2),
        "bench_cores": round(bench, 2),
        "other_cores": round(max(0.0, machine - stack - bench), 2),
        "steal": shares["steal"],
    }
