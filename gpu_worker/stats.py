"""What a GPU worker measures about itself: device busy time over a sliding
window, batch sizes and recent time bills. Published in its heartbeat."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from contract.timebill import percentile, summarise_bills


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
    """Batch sizes and time bills of the last minutes, summarised on demand."""

    def __init__(
        self, window_s: float = 300.0, max_jobs: int = 20_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self.batches: deque[tuple[float, int]] = deque(maxlen=max_jobs)
        self.bills: deque[tuple[float, Mapping[str, float]]] = deque(maxlen=max_jobs)
        self.batches_total = 0
        self.frames_total = 0

    def record_batch(self, size: int) -> None:
        self.batches.append((self.clock(), size))
        self.batches_total += 1
        self.frames_total += size

    def record_bill(self, bill: Mapping[str, float]) -> None:
        self.bills.append((self.clock(), bill))

    def latency(self) -> dict[str, Any]:
        """Recent jobs and their p95 request-to-result time, in ms (None without jobs)."""
        since = self.clock() - self.window_s
        totals = sorted(bill["total"] for t, bill in list(self.bills) if t >= since and "total" in bill)
        return {"jobs": len(totals), "p95_ms": round(percentile(totals, 95), 1) if totals else None}

    def summary(self) -> dict[str, Any]:
        since = self.clock() - self.window_s
        sizes = [size for t, size in list(self.batches) if t >= since]
        bills = [bill for t, bill in list(self.bills) if t >= since]
        return {
            "window_s": self.window_s,
            "batches": len(sizes),
            "batch_size_mean": round(sum(sizes) / len(sizes), 3) if sizes else None,
            "batch_size_histogram": dict(sorted(Counter(sizes).items())),
            "time_bill_ms": summarise_bills(bills),
        }
