"""How fast a model's backlog drains now, for a refusal's Retry-After (app.admission asks).

Measured, not averaged over the past: each GPU worker counts the frames it answered per model in its counters
hash (contract.redis.keys.model_frames_total, written with each batch's own write), and a refusal reads those totals,
at most once a second per model and API process. The rate is the totals' growth between readings of the last
WINDOW_S seconds, all taken while refusals came (so while work waited); readings further apart than IDLE_GAP_S
start a new measurement, since the quiet stretch between them says nothing of the rate while busy. A rate over
the workers' window of minutes counted that quiet too, and told a burst after an idle spell to wait many times
longer than its backlog took to drain.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from contract.redis.keys import Keys, model_frames_total
from contract.workers.heartbeat import live_heartbeats

READ_EVERY_S = 1.0  # one reading per model and API process a second, whatever the refusals
WINDOW_S = 10.0  # the rate is over this much of the latest readings: the workers' pace now
IDLE_GAP_S = 3.0  # readings further apart had a stretch without refusals between them: measured afresh
MAX_RETRY_AFTER_S = 60  # also what a model with no GPU worker serving it gets
TRUSTED_BEYOND = 2.0  # a rate measured over less than WINDOW_S answers at most this many times its span


@dataclass(frozen=True)
class Drain:
    """A model's drain as last measured: `unserved` (no live GPU worker serves it), `rate` (jobs a second, None
    until two readings span a second of refusals) and `span_s` (what the rate was measured over)."""

    unserved: bool = False
    rate: float | None = None
    span_s: float = 0.0


@dataclass(frozen=True)
class Reading:
    at: float  # monotonic seconds
    totals: dict[str, float]  # per GPU worker serving the model: its frames of the model answered so far


def drained_between(first: Reading, last: Reading) -> float:
    """Frames answered between two readings, over the workers in both; a total that went down is a worker that
    restarted, counted from zero."""
    drained = 0.0
    for worker, total in last.totals.items():
        before = first.totals.get(worker)
        if before is not None:
            drained += total - before if total >= before else total
    return drained


def measure(readings: deque[Reading]) -> float | None:
    """Jobs a second over the readings, None with fewer than two."""
    if len(readings) < 2:
        return None
    first, last = readings[0], readings[-1]
    return drained_between(first, last) / (last.at - first.at)


def retry_after_s(jobs: float, drain: Drain, least: int, most: int = MAX_RETRY_AFTER_S) -> int:
    """Whole seconds until `jobs` have drained, within [least, most]: `most` when no GPU worker serves the model,
    `least` while no rate is measured yet (the next refusal will know one), and while nothing drained over a
    measured span, that span (the longer the stall, the longer the answer); at most TRUSTED_BEYOND times the span
    while that is shorter than WINDOW_S."""
    if drain.unserved:
        return most
    if drain.rate is None:
        return least
    wait = drain.span_s if drain.rate <= 0 else max(0.0, jobs) / drain.rate
    if drain.span_s < WINDOW_S:
        # A rate watched for a second or two has seen a batch or none: a worker that answers a batch every second
        # or two reads as far slower than it is at a burst's start. Promise no more than twice what was watched;
        # a client back sooner than needed is refused again, with a rate measured over longer.
        wait = min(wait, TRUSTED_BEYOND * drain.span_s)
    return int(min(most, max(least, math.ceil(round(wait, 6)))))


class DrainMeter:
    """Per model, its drain rate from readings taken only when asked (a refusal), at most every READ_EVERY_S."""

    def __init__(
        self, client: redis.Redis, keys: Keys, heartbeat_ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.redis, self.keys, self.ttl_s, self.clock = client, keys, heartbeat_ttl_s, clock
        self._lock = threading.Lock()
        self._readings: dict[str, deque[Reading]] = {}
        self._last: dict[str, tuple[float, Drain]] = {}  # per model: when it was read, and what it said

    def drain(self, model_key: str) -> Drain:
        """The model's drain now: a fresh reading when the last is a second old, else the last answer."""
        now = self.clock()
        with self._lock:
            read_at, last = self._last.get(model_key, (-math.inf, Drain()))
            if now - read_at < READ_EVERY_S:
                return last
            self._last[model_key] = (now, last)  # the other callers of this second take the last answer meanwhile
        totals = self.read_totals(model_key)  # outside the lock: a Redis round trip
        return self._record(model_key, now, totals)

    def record(self, model_key: str, totals: dict[str, float] | None) -> Drain:
        """A reading taken by the caller (read_totals' figures, None: no live GPU worker serves the model), added
        as drain's own are: app.cell_choice reads them with its other figures, in one round trip."""
        return self._record(model_key, self.clock(), totals)

    def _record(self, model_key: str, now: float, totals: dict[str, float] | None) -> Drain:
        with self._lock:
            readings = self._readings.setdefault(model_key, deque())
            if totals is None:
                readings.clear()
                drain = Drain(unserved=True)
            else:
                if readings and now - readings[-1].at > IDLE_GAP_S:
                    readings.clear()
                readings.append(Reading(now, totals))
                while len(readings) > 2 and now - readings[1].at >= WINDOW_S:
                    readings.popleft()
                drain = Drain(rate=measure(readings), span_s=readings[-1].at - readings[0].at)
            self._last[model_key] = (now, drain)
            return drain

    def read_totals(self, model_key: str) -> dict[str, float] | None:
        """Each live GPU worker serving the model: its frames of it answered so far; None when none serves it."""
        serving = [
            beat.worker_id
            for beat in live_heartbeats(self.redis, self.keys, self.ttl_s)
            if any(model.key == model_key for model in beat.served_models())
        ]
        if not serving:
            return None
        pipe = self.redis.pipeline(transaction=False)
        for worker in serving:
            pipe.hget(self.keys.gpu_counters(worker), model_frames_total(model_key))
        replies: list[Any] = pipe.execute()
        return {worker: float(reply or 0) for worker, reply in zip(serving, replies, strict=True)}
