"""The GPU worker's recent window (gpu_worker.stats.RecentStats): the figures its heartbeat publishes, and the
memory it keeps, which must not grow with the jobs it has seen (issue 41)."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest

from contract.jobs.timebill import STAGES, percentile, summarise_bills
from gpu_worker.stats import RecentStats


class Clock:
    """Injected: the window is applied by time, and no test sleeps for it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def reference(
    bills: list[tuple[float, Mapping[str, float]]],
    batches: list[tuple[float, int]],
    now: float,
    window_s: float,
    max_jobs: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What RecentStats answered when it kept each bill as a dict (its code before issue 41): latency(),
    summary()."""
    since = now - window_s
    recent = [bill for t, bill in bills[-max_jobs:] if t >= since]
    totals = sorted(bill["total"] for bill in recent if "total" in bill)
    sizes = [size for t, size in batches[-max_jobs:] if t >= since]
    latency = {"jobs": len(totals), "p95_ms": round(percentile(totals, 95), 1) if totals else None}
    summary = {
        "window_s": window_s,
        "batches": len(sizes),
        "batch_size_mean": round(sum(sizes) / len(sizes), 3) if sizes else None,
        "batch_size_histogram": dict(sorted(Counter(sizes).items())),
        "time_bill_ms": summarise_bills(recent),
    }
    return latency, summary


def random_bill(rng: random.Random) -> dict[str, float]:
    """A time bill as contract.jobs.timebill makes them: milliseconds rounded to 3 places, some stages missing."""
    return {stage: round(rng.uniform(0.0, 400.0), 3) for stage in STAGES if stage == "total" or rng.random() < 0.8}


@pytest.mark.parametrize("jobs", [0, 1, 7, 250, 1900])
def test_figures_match_the_dict_window_to_the_last_digit(jobs: int) -> None:
    rng = random.Random(jobs)
    clock, max_jobs, window_s = Clock(), 500, 60.0
    stats = RecentStats(window_s=window_s, max_jobs=max_jobs, clock=clock)
    bills: list[tuple[float, Mapping[str, float]]] = []
    batches: list[tuple[float, int]] = []
    for _ in range(jobs):
        clock.now += rng.expovariate(15.0)  # ~15 jobs/s: the window holds ~900, the ring 500, both cut
        bill = random_bill(rng)
        stats.record_bill(bill)
        bills.append((clock.now, bill))
        if rng.random() < 0.4:
            size = rng.randint(1, 8)
            stats.record_batch(size)
            batches.append((clock.now, size))
    for _ in range(3):  # read now, then as the window moves past the older jobs
        latency, summary = reference(bills, batches, clock.now, window_s, max_jobs)
        assert stats.latency() == latency
        assert stats.summary() == summary
        clock.now += 25.0
    assert stats.batches_total == len(batches)
    assert stats.frames_total == sum(size for _, size in batches)


def test_the_window_is_applied_when_read() -> None:
    clock = Clock()
    stats = RecentStats(window_s=300.0, clock=clock)
    stats.record_batch(4)
    for total in (100.0, 200.0):
        stats.record_bill({"infer": 50.0, "total": total})
    clock.now += 299.0
    stats.record_bill({"infer": 70.0, "total": 300.0})
    assert stats.latency() == {"jobs": 3, "p95_ms": 290.0}
    clock.now += 2.0  # the first three records are 301 s old now, the last one 2 s
    assert stats.latency() == {"jobs": 1, "p95_ms": 300.0}
    assert stats.summary()["batches"] == 0
    assert stats.summary()["time_bill_ms"]["infer"]["p50"] == 70.0
    clock.now += 300.0
    assert stats.latency() == {"jobs": 0, "p95_ms": None}
    assert stats.summary() == {
        "window_s": 300.0,
        "batches": 0,
        "batch_size_mean": None,
        "batch_size_histogram": {},
        "time_bill_ms": {},
    }
    assert stats.batches_total == 1 and stats.frames_total == 4  # the totals are for the worker's life


def test_the_ring_keeps_the_last_max_jobs() -> None:
    stats = RecentStats(window_s=300.0, max_jobs=5, clock=Clock())
    for total in range(12):
        stats.record_bill({"total": float(total)})
        stats.record_batch(total % 3 + 1)
    assert stats.latency()["jobs"] == 5
    assert stats.summary()["time_bill_ms"]["total"]["p50"] == 9.0  # 7, 8, 9, 10, 11
    assert stats.summary()["batch_size_histogram"] == {1: 1, 2: 2, 3: 2}  # sizes of records 7..11: 2 3 1 2 3


def test_memory_does_not_grow_with_the_jobs_recorded() -> None:
    """The ring is allocated whole at the start; recording three rings' worth of bills keeps nothing more. The dict
    window kept ~1 KB a bill, here it would be ~3 MB."""
    max_jobs = 1000
    rng = random.Random(1)
    bills = [random_bill(rng) for _ in range(3 * max_jobs)]
    clock = Clock()
    tracemalloc.start()
    try:
        stats = RecentStats(max_jobs=max_jobs, clock=clock)
        stats.record_bill(bills[0])
        stats.record_batch(8)
        before = tracemalloc.get_traced_memory()[0]
        for bill in bills:
            clock.now += 0.01
            stats.record_bill(bill)
            stats.record_batch(8)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 16 * 1024, f"{grown} bytes kept for {len(bills)} bills"
    assert stats.latency()["jobs"] == max_jobs


def test_refuses_an_empty_ring() -> None:
    with pytest.raises(ValueError):
        RecentStats(max_jobs=0)
