"""The figures admission reads from Redis at most once a second per process (app.admission asks them): Redis's
memory against its maxmemory, and the API keys whose own CPU queues a live worker takes."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import redis

from contract.redis.clock import now as service_now
from contract.redis.keys import Keys

log = logging.getLogger("app.admission")  # its warnings read as admission's, as before the split

LOOK_S = 1.0  # how stale Redis's memory figures and the served API keys may be: one read per process a second

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
        if tenant not in self._warned:  # a set's add is atomic: at worst two threads both warn once
            self._warned.add(tenant)
            log.warning(
                "no live CPU worker takes API key %s's own queues (is its config older than the "
                "API's?): its jobs share the common queues meanwhile",
                tenant,
            )
        return False

    def _read(self) -> frozenset[str]:
        seen: Any = self.redis.hgetall(self.keys.cpu_tenants)
        oldest = service_now() - self.ttl_s
        return frozenset(key.decode() for key, at in seen.items() if float(at) >= oldest)
