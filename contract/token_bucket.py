"""A token bucket per name in Redis: the per-key request rate (`auth.rate_per_s`, `auth.burst`) and the failed
authentications per address (`auth.failed_per_s`, `auth.failed_burst`). The API's admission (app.admission)
asks it; an empty bucket is a 429 with Retry-After there."""

from __future__ import annotations

from typing import Any, NamedTuple

import redis

from contract.clock import now as service_now

# KEYS[1] bucket hash; ARGV rate (tokens/s), burst, now (the service's clock, contract.clock: the one every
# moment is read by). Returns {allowed, retry_after_ms}. The refill's mark never moves back: each API process
# carries the clock forward on its own, a request that ran later may bring an earlier moment, and moving the mark
# back refilled the same interval twice (75 requests let through against a bound of 50, from 50 connections at
# once, when each process read its host's clock).
# refilled(tokens, at, now, rate, burst): a bucket's tokens at `now` and its new mark, from what it held at its mark
# `at` (nil: a new bucket, full); every bucket of the service refills by it (the cache hits': contract.jobs.hits).
REFILL_LUA = """
local function refilled(tokens, at, now, rate, burst)
  at = tonumber(at) or now
  if now < at then now = at end
  return math.min(burst, (tonumber(tokens) or burst) + (now - at) * rate), now
end
"""
TAKE_TOKEN_LUA = (
    REFILL_LUA
    + """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens, now = refilled(state[1], state[2], tonumber(ARGV[3]), rate, burst)
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
if allowed == 1 then return {1, 0} end
return {0, math.ceil((1 - tokens) / rate * 1000)}
"""
)


class Taken(NamedTuple):
    allowed: bool
    retry_after_ms: int  # 0 when allowed


class TokenBuckets:
    """The buckets in one Redis."""

    def __init__(self, client: redis.Redis) -> None:
        self._take = client.register_script(TAKE_TOKEN_LUA)

    def take(self, bucket: str, rate_per_s: float, burst: float) -> Taken:
        """One token from `bucket` (refilled at `rate_per_s` up to `burst`), in one step."""
        reply: Any = self._take(keys=[bucket], args=[rate_per_s, burst, repr(service_now())])
        return Taken(bool(reply[0]), int(reply[1]))
