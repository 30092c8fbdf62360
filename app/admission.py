"""Whether the service takes a new job now: the model's backlog, the bytes waiting in Redis, and Redis itself.

One step in Redis checks a model's backlog (jobs waiting for a CPU or a GPU worker) and reserves the
upload's bytes against the model's budget and the total (contract.budget). Over the backlog or the model's
budget: 429, that model is overloaded (others are served). Over the total, or Redis past
`store_full_ratio` of its `maxmemory`: 503, the store is full for everyone. Either way `Retry-After` says
how long the waiting work takes to drain by enough, at the rate the GPU workers have answered this model's
jobs lately (their heartbeats), not a constant: a store that stays full says so.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import redis
from flask import g

from app.problems import Problem
from contract import budget
from contract.heartbeat import live_heartbeats
from contract.jobs import queue_depths
from contract.keys import Keys
from contract.settings import ModelSpec

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60        # also what a model with no GPU worker answering it gets
MEMORY_LOOK_S = 1.0           # how stale Redis's memory figures may be (one INFO per process per second)
TENANTS_LOOK_S = 1.0          # how stale the served API keys may be (one HGETALL per process per second)


class RedisMemory:
    """Redis's used memory against its maxmemory, read at most once a second per process."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._share = 0.0

    def share(self) -> float:
        """used_memory / maxmemory (0 when Redis has no maxmemory)."""
        now = time.monotonic()
        with self._lock:
            if now - self._read_at < MEMORY_LOOK_S:
                return self._share
            self._read_at = now
        info: Any = self.redis.info("memory")
        limit = int(info.get("maxmemory") or 0)
        share = int(info.get("used_memory") or 0) / limit if limit else 0.0
        with self._lock:
            self._share = share
        return share


class ServedTenants:
    """The API keys whose own CPU queues a live CPU worker takes (Keys.cpu_tenants, refreshed by the
    workers' heartbeats), read at most once a second per process. A key added to the API's config before
    the workers were restarted with it has no such worker: its jobs go to the shared queues meanwhile,
    where they are served, rather than to queues nobody takes."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: float) -> None:
        self.redis, self.keys, self.ttl_s = client, keys, ttl_s
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._served: frozenset[str] = frozenset()
        self._warned: set[str] = set()

    def served(self, tenant: str) -> bool:
        now = time.monotonic()
        with self._lock:
            stale = now - self._read_at >= TENANTS_LOOK_S
            if stale:
                self._read_at = now
        if stale:
            seen: Any = self.redis.hgetall(self.keys.cpu_tenants)
            oldest = time.time() - self.ttl_s
            served = frozenset(key.decode() for key, at in seen.items() if float(at) >= oldest)
            with self._lock:
                self._served = served
        with self._lock:
            if tenant in self._served:
                return True
            if tenant not in self._warned:
                self._warned.add(tenant)
                log.warning("no live CPU worker takes API key %s's own queues (is its config older than the "
                            "API's?): its jobs share the common queues meanwhile", tenant)
            return False


def admit(services: Any, spec: ModelSpec, size: int) -> int:
    """Reserve `size` bytes for a new job of `spec`'s, or refuse with a problem; the bytes reserved."""
    settings = services.settings
    pressure = settings.backpressure
    if services.memory.share() >= pressure.store_full_ratio:
        raise Problem(503, "store-full", "Service unavailable",
                      "the job store is full; retry later",
                      headers={"Retry-After": str(_retry_after(services, spec, 1.0))})
    tenant = g.get("client_id") or ""
    if tenant and not services.tenants.served(tenant):
        tenant = ""
    g.queue_tenant = tenant   # where app.jobs queues the job, as counted here
    limit = settings.max_backlog(spec)
    share = max(1, int(limit * settings.auth.max_backlog_share)) if tenant else limit
    verdict = services.waiting.admit(spec.key, size, limit, settings.max_waiting_bytes(spec),
                                     pressure.max_total_waiting_bytes, tenant, settings.tenants, share)
    if verdict.verdict == budget.ADMITTED:
        return size
    if verdict.verdict == budget.OVER_TENANT_BACKLOG:
        retry = _retry_after(services, spec, (verdict.backlog - share + 1) / max(1, verdict.backlog))
        raise Problem(429, "overloaded", "Too many requests",
                      f"{verdict.backlog} of your jobs are waiting for model {spec.key} (your share of its backlog "
                      f"is {share}); retry later", headers={"Retry-After": str(retry)})
    if verdict.verdict == budget.OVER_BACKLOG:
        limit = settings.max_backlog(spec)
        retry = _retry_after(services, spec, (verdict.backlog - limit + 1) / max(1, verdict.backlog))
        raise Problem(429, "overloaded", "Too many requests",
                      f"{verdict.backlog} jobs are waiting for model {spec.key} (limit {limit}); retry later",
                      headers={"Retry-After": str(retry)})
    if verdict.verdict == budget.OVER_MODEL_BYTES:
        limit = settings.max_waiting_bytes(spec)
        retry = _retry_after(services, spec, (verdict.model_bytes + size - limit) / max(1, verdict.model_bytes))
        raise Problem(429, "overloaded", "Too many requests",
                      f"model {spec.key} has {verdict.model_bytes} bytes of images waiting (limit {limit}); "
                      "retry later", headers={"Retry-After": str(retry)})
    limit = pressure.max_total_waiting_bytes
    retry = _retry_after(services, spec, (verdict.all_bytes + size - limit) / max(1, verdict.all_bytes))
    raise Problem(503, "store-full", "Service unavailable",
                  f"{verdict.all_bytes} bytes of images are waiting (limit {limit}); retry later",
                  headers={"Retry-After": str(retry)})


def _retry_after(services: Any, spec: ModelSpec, share: float) -> int:
    """Seconds until `share` of the model's waiting work has drained at its recent rate, within
    [backpressure.retry_after_s, MAX_RETRY_AFTER_S]; the most when no GPU worker answers it."""
    least = services.settings.backpressure.retry_after_s
    try:
        depths = queue_depths(services.redis, services.keys, [spec.key], services.settings.tenants)
        backlog = sum(depths[spec.key].values())
        rate = drain_rate(services, spec.key)
    except redis.RedisError:
        return least
    if rate <= 0:
        return MAX_RETRY_AFTER_S
    return int(min(MAX_RETRY_AFTER_S, max(least, math.ceil(max(share, 0.0) * backlog / rate))))


def drain_rate(services: Any, model_key: str) -> float:
    """Jobs a second the live GPU workers answered for this model over their recent window."""
    rate = 0.0
    for beat in live_heartbeats(services.redis, services.keys, services.settings.gpu_worker.heartbeat_ttl_s):
        window = float(beat.stats.get("window_s") or 0.0)
        for model in beat.served_models():
            if model.key == model_key and window > 0:
                rate += float(model.stats.get("jobs", 0)) / window
    return rate
