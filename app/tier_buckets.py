"""The API tier's token buckets with cells (docs/cells.md): the per-key rate limits and the failed authentications,
in the tier's own Redis (the top-level `redis_url`), and in this process while that Redis does not answer.

A tier's Redis that is away must not stop the cells from serving: each bucket is then kept in this process (the
same rate and burst, so a key spread over N API processes gets at most N times its rate meanwhile), and the tier's
Redis is asked again after `retry_s`. A one-cell deployment does not use this: its buckets are its Redis's, as
they always were (contract.admission.token_bucket).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import redis

from contract.admission.token_bucket import Taken, TokenBuckets

log = logging.getLogger("app.tier")

TIER_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class LocalBuckets:
    """Token buckets in this process: what the tier's Redis does in take_token (contract/library/token_bucket.lua),
    kept in a dict."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_buckets: int = 100_000) -> None:
        self.clock, self.max_buckets = clock, max_buckets
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # name: (tokens, at)

    def take(self, bucket: str, rate_per_s: float, burst: float) -> Taken:
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(bucket, (burst, now))
            tokens = min(burst, tokens + max(0.0, now - at) * rate_per_s)
            allowed = tokens >= 1
            if allowed:
                tokens -= 1
            if len(self._buckets) >= self.max_buckets and bucket not in self._buckets:
                self._buckets.clear()  # a flood of new names (failed authentications by address): start afresh
            self._buckets[bucket] = (tokens, now)
        return Taken(True, 0) if allowed else Taken(False, math.ceil((1 - tokens) / rate_per_s * 1000))


class TierBuckets:
    """The tier's buckets: in its Redis while that answers, else in this process for `retry_s` at a time."""

    def __init__(self, client: redis.Redis, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.shared, self.local = TokenBuckets(client), LocalBuckets(clock)
        self.retry_s, self.clock = retry_s, clock
        self._down_until = 0.0

    @property
    def up(self) -> bool:
        return self._down_until <= self.clock()

    def take(self, bucket: str, rate_per_s: float, burst: float) -> Taken:
        if self.up:
            try:
                return self.shared.take(bucket, rate_per_s, burst)
            except TIER_ERRORS as exc:
                log.warning("the API tier's Redis did not answer (%s): rate limits in this process for now", exc)
                self._down_until = self.clock() + self.retry_s
        return self.local.take(bucket, rate_per_s, burst)
