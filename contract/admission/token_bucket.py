"""A token bucket per name in Redis: the per-key request rate (`auth.rate_per_s`, `auth.burst`) and the failed
authentications per address (`auth.failed_per_s`, `auth.failed_burst`). The API's admission (app.admission)
asks it; an empty bucket is a 429 with Retry-After there."""

from __future__ import annotations

from typing import Any, NamedTuple

import redis

from contract.library import Step
from contract.redis.clock import now as service_now

# The step `take_token` (contract/library/token_bucket.lua): the refill's mark never moves back, there and in
# every bucket of the service (a mark moved back by a process whose host's clock is behind refills the bucket
# twice, letting more through than its bound).
_TAKE_TOKEN = Step("take_token")


class Taken(NamedTuple):
    allowed: bool
    retry_after_ms: int  # 0 when allowed


class TokenBuckets:
    """The buckets in one Redis."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def take(self, bucket: str, rate_per_s: float, burst: float) -> Taken:
        """One token from `bucket` (refilled at `rate_per_s` up to `burst`), in one step."""
        reply: Any = _TAKE_TOKEN(self.redis, [bucket], [rate_per_s, burst, repr(service_now())])
        return Taken(bool(reply[0]), int(reply[1]))
