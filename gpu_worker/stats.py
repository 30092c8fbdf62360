"""What a GPU worker measures about itself: device busy time over a sliding
window, batch sizes and recent time bills. Published in its heartbeat."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from contract.jobs.timebill import STAGES, percentile, stage_figures


class BusyMeter:
    """Fraction of wall time the device spent on batches, over a sliding window."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self.intervals: deque[tuple[float, float]] = deque()
        self.total_s = 0.0

    def record(self, start: float, end: float) -> None:
        self.intervals.append((start, end))
        self.total_s += end - start
        self._prune(end)

    def fraction(self, now: float | None = None, window_s: float | None = None) -> float:
        now = self.clock() if now is None else now
        window = min(window_s or self.window_s, max(now - self.started, 1e-9))
        since = now - window
        busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in list(self.intervals))
        return min(1.0, busy / window)

    def _prune(self, now: float) -> None:
        while self.intervals and self.intervals[0][1] < now - self.window_s:
            self.intervals.popleft()


class RecentStats:
    """Batch sizes and time bills of the last minutes, summarised on demand.

    Held in arrays allocated once at full size: a ring of `max_jobs` bills (their times, and a row of
    milliseconds per stage of contract.jobs.timebill.STAGES, NaN where a bill has no such stage) and one of `max_jobs`
    batches. Bills kept as dicts in two windows (its own and its model's) that fill up only at `max_jobs` grow the
    worker for as long as they fill (docs/benchmarks/2026-12-05-soak.md); this one's memory is all taken at the
    start. The window (`window_s`) is applied
    when read: what is older is ignored, and overwritten as the ring comes round."""

    def __init__(
        self, window_s: float = 300.0, max_jobs: int = 20_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.window_s = window_s
        self.clock = clock
        self.max_jobs = max_jobs
        # -inf: a slot never written is older than any window. np.full writes every page now: the RSS is taken
        # at the start, not as the ring fills.
        self._bill_at = np.full(max_jobs, -np.inf)
        self._bills = np.full((max_jobs, len(STAGES)), np.nan)
        self._batch_at = np.full(max_jobs, -np.inf)
        self._batch_sizes = np.zeros(max_jobs, dtype=np.int64)
        self._bills_written = 0
        self._batches_written = 0
        # The finish thread writes, the heartbeat thread reads: a reader must not see a row half written.
        self._lock = threading.Lock()
        self.batches_total = 0
        self.frames_total = 0

    def record_batch(self, size: int) -> None:
        with self._lock:
            slot = self._batches_written % self.max_jobs
            self._batch_at[slot] = self.clock()
            self._batch_sizes[slot] = size
            self._batches_written += 1
        self.batches_total += 1
        self.frames_total += size

    def record_bill(self, bill: Mapping[str, float]) -> None:
        row = [bill.get(stage, _MISSING) for stage in STAGES]
        with self._lock:
            slot = self._bills_written % self.max_jobs
            self._bill_at[slot] = self.clock()
            self._bills[slot] = row
            self._bills_written += 1

    def _recent_bills(self) -> np.ndarray:
        """The bills of the window, oldest first: [jobs, len(STAGES)], NaN where a stage is missing."""
        since = self.clock() - self.window_s
        with self._lock:
            order = _ring_order(self._bills_written, self.max_jobs)
            return self._bills[order[self._bill_at[order] >= since]]

    def _recent_sizes(self) -> list[int]:
        since = self.clock() - self.window_s
        with self._lock:
            order = _ring_order(self._batches_written, self.max_jobs)
            return self._batch_sizes[order[self._batch_at[order] >= since]].tolist()

    def latency(self) -> dict[str, Any]:
        """Recent jobs and their p95 request-to-result time, in ms (None without jobs)."""
        column = self._recent_bills()[:, _TOTAL]
        totals = np.sort(column[~np.isnan(column)]).tolist()
        return {"jobs": len(totals), "p95_ms": round(percentile(totals, 95), 1) if totals else None}

    def summary(self) -> dict[str, Any]:
        sizes = self._recent_sizes()
        return {
            "window_s": self.window_s,
            "batches": len(sizes),
            "batch_size_mean": round(sum(sizes) / len(sizes), 3) if sizes else None,
            "batch_size_histogram": dict(sorted(Counter(sizes).items())),
            "time_bill_ms": summarise_columns(self._recent_bills()),
        }


_MISSING = float("nan")
_TOTAL = STAGES.index("total")


def _ring_order(written: int, size: int) -> np.ndarray:
    """The slots of a ring of `size` that `written` writes filled, oldest first."""
    if written <= size:
        return np.arange(written)
    start = written % size
    return np.concatenate((np.arange(start, size), np.arange(start)))


def summarise_columns(bills: np.ndarray) -> dict[str, dict[str, float]]:
    """summarise_bills of bills held as rows of STAGES (NaN: the stage missing), oldest first: the same figures,
    computed by the same sums in the same order (a mean adds the sorted values, the mean total adds them in
    the order the bills came, as summarise_bills does), so the two agree to the last digit."""
    columns = {}
    for index, stage in enumerate(STAGES):
        column = bills[:, index]
        columns[stage] = column[~np.isnan(column)]
    totals = columns["total"].tolist()
    mean_total = sum(totals) / len(totals) if totals else 0.0
    summary: dict[str, dict[str, float]] = {}
    for stage in STAGES:
        values = np.sort(columns[stage]).tolist()
        if not values:
            continue
        summary[stage] = stage_figures(values, mean_total, stage)
    return summary
