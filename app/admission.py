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
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import redis
from flask import g

from app.problems import Problem
from contract import budget
from contract.heartbeat import live_heartbeats
from contract.jobs.backlog import queue_depths
from contract.keys import Keys
from contract.models import ModelSpec

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60        # also what a model with no GPU worker answering it gets
LOOK_S = 1.0   # how stale Redis's memory figures and the served API keys may be: one read per process a second

T = TypeVar("T")


class ReadAtMostEvery(Generic[T]):
    """A figure read from Redis at most once per `interval_s` in this process; calls in between, from any
    thread, get the last reading (the first call reads)."""

    def __init__(self, interval_s: float, read: Callable[[], T], initial: T) -> None:
        self.interval_s, self.read = interval_s, read
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._value = initial

    def get(self) -> T:
        now = time.monotonic()
        with self._lock:
            if now - self._read_at < self.interval_s:
                return self._value
            self._read_at = now
        value = self.read()
        with self._lock:
            self._value = value
        return value


class RedisMemory:
    """Redis's used memory against its maxmemory, read at most once a second per process."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._share = ReadAtMostEvery(LOOK_S, self._read, 0.0)

    def share(self) -> float:
        """used_memory / maxmemory (0 when Redis has no maxmemory)."""
        return self._share.get()

    def _read(self) -> float:
        info: Any = self.redis.info("memory")
        limit = int(info.get("maxmemory") or 0)
        return int(info.get("used_memory") or 0) / limit if limit else 0.0


class ServedTenants:
    """The API keys whose own CPU queues a live CPU worker takes (Keys.cpu_tenants, refreshed by the
    workers' heartbeats), read at most once a second per process. A key added to the API's config before
    the workers were restarted with it has no such worker: its jobs go to the shared queues meanwhile,
    where they are served, rather than to queues nobody takes."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: float) -> None:
        self.redis, self.keys, self.ttl_s = client, keys, ttl_s
        self._served: ReadAtMostEvery[frozenset[str]] = ReadAtMostEvery(LOOK_S, self._read, frozenset())
        self._warned: set[str] = set()

    def served(self, tenant: str) -> bool:
        if tenant in self._served.get():
            return True
        if tenant not in self._warned:   # a set's add is atomic: at worst two threads both warn once
            self._warned.add(tenant)
            log.warning("no live CPU worker takes API key %s's own queues (is its config older than the "
                        "API's?): its jobs share the common queues meanwhile", tenant)
        return False

    def _read(self) -> frozenset[str]:
        seen: Any = self.redis.hgetall(self.keys.cpu_tenants)
        oldest = time.time() - self.ttl_s
        return frozenset(key.decode() for key, at in seen.items() if float(at) >= oldest)


def admit(services: Any, spec: ModelSpec, size: int) -> int:
    """Reserve `size` bytes for a new job of `spec`'s, or refuse with a problem; the bytes reserved."""
    request = admission_request(services, spec, size)
    settle(services, spec, request, services.waiting.admit(*request))
    return size


def admission_request(services: Any, spec: ModelSpec, size: int) -> budget.AdmissionRequest:
    """What a new job of `spec`'s asks of the budgets, for this request's API key; a 503 at once while Redis is
    past `store_full_ratio` of its memory."""
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
    return budget.AdmissionRequest(spec.key, size, limit, settings.max_waiting_bytes(spec),
                                   pressure.max_total_waiting_bytes, tenant, settings.tenants, share)


def settle(services: Any, spec: ModelSpec, request: budget.AdmissionRequest, verdict: budget.Admission) -> None:
    """Nothing when `verdict` admitted the job; else the problem that says which limit refused it."""
    settings = services.settings
    pressure = settings.backpressure
    size = request.size
    share = request.max_tenant_backlog or request.max_backlog
    if verdict.verdict == budget.ADMITTED:
        return
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
