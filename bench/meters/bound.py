"""`bench bound`: what the latency profile alone allows, before any software.

An event simulation of an ideal GPU worker: Poisson arrivals, zero host
overhead, greedy dynamic batching (a batch closes when the device is free and
its window has passed, taking up to max batch frames), service times from the
simulated device's profile. Its p95 is a floor for the device-side part of any
real deployment's latency at that load: use it to tell a slow pipeline from a
target the device cannot meet.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from contract.jobs.timebill import percentile
from gpu_worker.simulated import profile_latency_s


def ideal_latencies(
    profile_ms: Mapping[int, float],
    qps: float,
    window_s: float,
    max_batch: int,
    duration_s: float = 3600.0,
    seed: int = 1,
) -> tuple[list[float], float]:
    """Sorted per-image latencies (s) from arrival to batch end, and the device busy fraction."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(qps)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(qps)
    latencies, device_free, busy, i = [], 0.0, 0.0, 0
    while i < len(arrivals):
        start = max(device_free, arrivals[i] + window_s)
        j = i
        while j < len(arrivals) and arrivals[j] <= start and j - i < max_batch:
            j += 1
        service = profile_latency_s(profile_ms, j - i)
        latencies += [start + service - a for a in arrivals[i:j]]
        device_free, busy, i = start + service, busy + service, j
    return sorted(latencies), busy / device_free


def describe(profile_ms: Mapping[int, float], rates: list[float], window_ms: float, max_batch: int) -> str:
    lines = ["| offered QPS | device-side p50 ms | p95 ms | p99 ms | GPU busy |", "|---|---|---|---|---|"]
    for qps in rates:
        lat, busy = ideal_latencies(profile_ms, qps, window_ms / 1000.0, max_batch)
        ms = [percentile(lat, q) * 1000 for q in (50, 95, 99)]
        lines.append(f"| {qps:g} | {ms[0]:.0f} | {ms[1]:.0f} | {ms[2]:.0f} | {busy:.0%} |")
    return "\n".join(lines) + (
        "\n\nIdeal device-side latency (no HTTP, queue, decode or host overhead): "
        "a floor for the end-to-end figures at the same load."
    )
