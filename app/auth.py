"""API keys and per-key rate limits for the /v1 routes.

Keys are configured hashed (`auth.api_keys: [{id, sha256}]`); when any are
set, every /v1 route needs `Authorization: Bearer <key>`, and a job is visible
only to the key that created it. Each key has a token bucket in Redis
(`auth.rate_per_s`, `auth.burst`); an empty bucket answers 429 + Retry-After.

    python -m app.auth <key>        # prints the sha256 to put in the config
"""

from __future__ import annotations

import hashlib
import hmac
import math
import sys
from collections.abc import Mapping
from typing import Any

from flask import g, request

from app.problems import Problem
from app.services import services as current_services

# KEYS[1] bucket hash; ARGV rate (tokens/s), burst. Returns {allowed, retry_after_ms}. The time is Redis's own
# (TIME), and the refill's mark never moves back: with each API process's clock, a request that ran later
# with an earlier time moved it back, and the same interval refilled twice (75 requests let through
# against a bound of 50, from 50 connections at once).
_TAKE_TOKEN = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
if now < at then now = at end
tokens = math.min(burst, tokens + (now - at) * rate)
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


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def install(app) -> None:
    services = current_services(app)
    take_token = services.redis.register_script(_TAKE_TOKEN)

    @app.before_request
    def authenticate() -> None:
        g.client_id = None
        settings = services.settings.auth
        # /metrics too, where it is served on this port (api.metrics_port 0): every tenant's job counts.
        if not (request.path.startswith("/v1/") or request.path == "/metrics") or not settings.api_keys:
            return
        try:
            g.client_id = _client_for(request.headers.get("Authorization", ""), settings.api_keys)
        except Problem:
            # Each address may fail to authenticate only so often: 300 guesses ran at 480/s, all 401.
            if settings.failed_per_s > 0:
                allowed, retry_ms = take_token(
                    keys=[services.keys.auth_failures(request.remote_addr or "-")],
                    args=[settings.failed_per_s, settings.failed_burst],
                )
                if not allowed:
                    raise Problem(
                        429,
                        "too-many-failed-authentications",
                        "Too many requests",
                        "this address failed to authenticate too often; retry later",
                        headers={"Retry-After": str(max(1, math.ceil(retry_ms / 1000)))},
                    ) from None
            raise
        if request.path == "/metrics":  # every tenant's job counts: an admin key's (app.metrics serves it)
            require_admin(settings.api_keys)
        if settings.rate_per_s > 0:
            allowed, retry_ms = take_token(
                keys=[services.keys.rate_bucket(g.client_id)], args=[settings.rate_per_s, settings.burst]
            )
            if not allowed:
                raise Problem(
                    429,
                    "rate-limited",
                    "Too many requests",
                    f"key {g.client_id!r} is over {settings.rate_per_s:g} requests/s",
                    headers={"Retry-After": str(max(1, math.ceil(retry_ms / 1000)))},
                )


def _client_for(header: str, api_keys) -> str:
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise Problem(
            401,
            "unauthorized",
            "Unauthorized",
            "send Authorization: Bearer <api key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    digest = hash_key(key.strip())
    for entry in api_keys:
        if hmac.compare_digest(digest, str(entry["sha256"])):
            return str(entry["id"])
    raise Problem(401, "unauthorized", "Unauthorized", "unknown API key", headers={"WWW-Authenticate": "Bearer"})


def is_admin(api_keys) -> bool:
    """Whether this request may see figures about every tenant's traffic: without keys anyone, with keys an
    `admin: true` key."""
    client_id = g.get("client_id")
    if client_id is None:
        return not api_keys
    return any(str(entry["id"]) == client_id and entry.get("admin") for entry in api_keys)


def require_admin(api_keys) -> None:
    """With keys, only an `admin: true` key may read figures about every tenant's traffic."""
    if not is_admin(api_keys):
        raise Problem(403, "forbidden", "Forbidden", "this route shows every tenant's traffic: it needs an admin key")


def owns(record: Mapping[str, Any]) -> bool:
    """Without keys every job is everyone's; with keys, only its creator's."""
    client_id = g.get("client_id")
    return client_id is None or record.get("owner") == client_id


if __name__ == "__main__":
    print(hash_key(sys.argv[1]))
