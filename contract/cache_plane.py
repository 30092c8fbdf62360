"""The result cache on a Redis of its own (`cache.redis_url`): where its entries and books live, and the circuit
that keeps a dead or slow cache Redis a miss, never an error and never a stall.

Unset, the cache lives on the control plane (each cell's own) and nothing here is used: contract.cache and the
library's steps there, as before. Set, the cache's keys (`Keys.cache_prefix`: the entries, the LRU set, the sizes,
the bytes charged, the hit and miss counters) live on that Redis, run `maxmemory-policy allkeys-lru` with its own
`maxmemory` (a backstop above `cache.max_bytes`, which the library's remember_all still keeps), and every API process
of every cell shares it: a repeated image hits whichever cell computed it. What stays on the control plane: a hit's
job record, its shared answer (`Keys.hit_result`, copied into the cell from the document the lookup read) and its
API key's hit bucket, all in the hit's one step there (`store_hit_answer`, contract/library/hits.lua).

Every call to the cache Redis is bounded by `cache.timeout_ms` (connect and reply) and goes through `CachePlane.call`:
an error or a timeout marks it down for `cache.retry_s` (as a bulk shard is: contract.shards), in which no call is
tried; the caller reads None: a lookup is a miss, a hit's touch or a write of entries is dropped.

The GPU worker's batch write ends its jobs on the control plane first (`write_batch`, which then returns the jobs that
succeeded in time with a `cache_key`), and stores their entries on the cache Redis after it, outside that step. A
failed write there, or a worker that dies between the two, leaves the entries unwritten: the next request for that
image misses and is computed again. Never the reverse: an entry is written only after its job's end stood.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis

from contract.connection import COMMAND_PACKER
from contract.library import Step, check_library_at_start
from contract.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")

# The library's `remember_entries` (contract/library/cache.lua): entries stored with their books on the cache Redis.
_REMEMBER = Step("remember_entries")
CACHE_ERRORS = (redis.RedisError, OSError)


class CachePlane:
    """The cache Redis as one process sees it: its client and whether it was found down lately."""

    def __init__(self, client: redis.Redis, address: str, retry_s: float, clock: Callable[[], float] = time.monotonic):
        self.client, self.address, self.retry_s, self.clock = client, address, retry_s, clock
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.dropped = 0  # calls not made or failed since the start (a statistic)

    @property
    def up(self) -> bool:
        return self._down_until <= self.clock()

    def mark_down(self, exc: BaseException) -> None:
        with self._lock:
            was_up = self.up
            self._down_until = self.clock() + self.retry_s
        if was_up:  # once a period, not once a request
            log.warning("the cache Redis %s is down (%s): misses for %.1f s", self.address, exc, self.retry_s)

    def call(self, action: Callable[[redis.Redis], T]) -> T | None:
        """`action` on the cache Redis; None (nothing done, or its answer lost) when it is down, slow or fails."""
        if not self.up:
            self.dropped += 1
            return None
        try:
            return action(self.client)
        except CACHE_ERRORS as exc:
            self.dropped += 1
            self.mark_down(exc)
            return None

    def lookup(self, entry_key: str) -> bytes | None:
        """The entry's document, or None: absent, or the cache Redis away (a miss either way)."""
        found: Any = self.call(lambda client: client.get(entry_key))
        return bytes(found) if found is not None else None

    def touch(
        self, entry_key: str, lru_key: str, stats_key: str, digest: str, now: float, model: str, ttl_s: int
    ) -> None:
        """A hit's books: its entry's TTL renewed, its LRU score moved up, the hit counted (one round trip)."""

        def books(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            pipe.expire(entry_key, ttl_s)
            pipe.zadd(lru_key, {digest: now}, xx=True)
            pipe.hincrby(stats_key, f"{model}:hits", 1)
            pipe.execute()

        self.call(books)

    def remember(self, names: Sequence[Any], entries: Sequence[tuple[str, str, float]]) -> bool:
        """Store (digest, result document, moment) entries with their books (CacheLimits' names); False when the
        write was dropped (the next request for those images misses)."""
        if not entries:
            return True
        args: list[Any] = [*names]
        for digest, document, moment in entries:
            args += [digest, document, repr(moment)]
        return self.call(lambda client: _REMEMBER(client, [], args)) is not None


def redis_address(url: str) -> str:
    """A Redis URL without its password or user: what /v1/stats and the logs may show."""
    parts = urlsplit(url)
    host = parts.hostname or parts.path or "?"
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path if parts.hostname else ''}"


_planes: dict[tuple[str, int, float], CachePlane] = {}
_planes_lock = threading.Lock()


def cache_plane(settings: Settings) -> CachePlane | None:
    """The process's cache Redis (one for every cell it serves, so one circuit); None: the cache on the control plane.
    The library is checked there at the first use (a Redis away now: the first write loads it)."""
    section = settings.cache
    if not section.redis_url:
        return None
    key = (section.redis_url, section.timeout_ms, section.retry_s)
    with _planes_lock:
        if key not in _planes:
            timeout = section.timeout_ms / 1000.0
            client = redis.Redis.from_url(
                section.redis_url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry_on_timeout=False,
                health_check_interval=30,
                command_packer=COMMAND_PACKER,
            )
            address = redis_address(section.redis_url)
            check_library_at_start(client, log)
            _planes[key] = CachePlane(client, address, section.retry_s)
        return _planes[key]
