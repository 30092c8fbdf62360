"""The result cache on a Redis of its own (`cache.redis_url`): its entries there, without books, and the circuit that
keeps a dead or slow cache Redis a miss, never an error and never a stall.

Unset, the cache lives on the control plane (each cell's own) and nothing here is used: contract.cache and the
library's steps there, as before. Set, the entries (`Keys.cache_entry`) and the hit and miss counters
(`Keys.cache_stats`) live on that Redis, which every API process of every cell shares: a repeated image hits
whichever cell computed it. Nothing keeps an LRU set, sizes or a byte total there: an entry is a plain `SET ... EX ttl
NX` (one pipeline a batch, no function), its TTL expires it, and Redis's own `maxmemory` with an `allkeys-lru` (or
any evicting) policy evicts the least recently used when full; a GET is a use. A cache Redis that does not evict is
warned about once (it fills, then refuses writes: dropped writes, misses, never an error). What stays on the control
plane: a hit's job record, its shared answer (`Keys.hit_result`) and its API key's hit bucket, all in the hit's one
step there (`store_hit_answer`, contract/library/hits.lua).

Every call to the cache Redis is bounded by `cache.timeout_ms` (connect and reply) and goes through `CachePlane.call`:
an error or a timeout marks it down for `cache.retry_s` (as a bulk shard is: contract.redis.shards), in which no call is
tried; the caller reads None: a lookup is a miss, a hit's touch or a write of entries is dropped. A write refused
for memory (OOM under `noeviction`) is dropped without marking it down: its lookups still answer.

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
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis

from contract.redis.connection import COMMAND_PACKER
from contract.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")

CACHE_ERRORS = (redis.RedisError, OSError)
SIZE_READ_S = 1.0  # /v1/stats and the size gauges read the cache Redis's INFO at most this often a process
# Policies under which a full cache Redis makes room by itself (entries all carry a TTL, so volatile-* do too).
EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu", "volatile-random")


@dataclass(frozen=True)
class CacheSize:
    """The cache Redis as its own INFO tells it (no books kept): `entries`, the keys that carry a TTL in its database
    (every entry does; the hit and miss counters do not); `used_bytes`, its used_memory (the entries plus Redis's
    own overhead and the counters); `maxmemory` (0: none) and `policy`, its maxmemory-policy."""

    entries: int
    used_bytes: int
    maxmemory: int
    policy: str


class CachePlane:
    """The cache Redis as one process sees it: its client and whether it was found down lately."""

    def __init__(self, client: redis.Redis, address: str, retry_s: float, clock: Callable[[], float] = time.monotonic):
        self.client, self.address, self.retry_s, self.clock = client, address, retry_s, clock
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.dropped = 0  # calls not made or failed, and entries refused, since the start (a statistic)
        self._size: CacheSize | None = None
        self._size_at = -SIZE_READ_S
        self._warned = False

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

    def touch(self, entry_key: str, stats_key: str, model: str, ttl_s: int) -> None:
        """A hit: its entry's TTL renewed (the GET was its LRU use), the hit counted (one round trip)."""

        def books(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            pipe.expire(entry_key, ttl_s)
            pipe.hincrby(stats_key, f"{model}:hits", 1)
            pipe.execute()

        self.call(books)

    def remember(self, entries: Sequence[tuple[str, str]], ttl_s: int, max_bytes: int) -> int | None:
        """Store (entry key, result document) entries, `SET NX` with the TTL (the first answer of an image stays),
        in one round trip; none when `max_bytes` is 0, and no document above it. How many were refused for memory
        (a full cache Redis that does not evict); None when the write was dropped (the cache Redis away): either way
        the next request for those images misses."""
        kept = [(key, document) for key, document in entries if 0 < len(document) <= max_bytes]
        if not kept:
            return 0

        def write(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key, document in kept:
                pipe.set(key, document, ex=ttl_s, nx=True)
            return pipe.execute(raise_on_error=False)

        replies = self.call(write)
        if replies is None:
            return None
        refused = [reply for reply in replies if isinstance(reply, redis.ResponseError)]
        if refused:  # OOM under noeviction: the cache is full, its reads still answer; not a reason to go down
            self.dropped += len(refused)
            log.info(
                "%d result-cache entries refused by the cache Redis %s: %s", len(refused), self.address, refused[0]
            )
        return len(refused)

    def size(self) -> CacheSize | None:
        """The cache Redis's INFO memory and keyspace, read at most once a SIZE_READ_S (one round trip); None when it
        is away. Warns once a process when it neither evicts nor has a maxmemory: the cache would fill it."""
        now = self.clock()
        if self._size is not None and now - self._size_at < SIZE_READ_S:
            return self._size
        db = int(self.client.connection_pool.connection_kwargs.get("db", 0))

        def read(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.info("memory")
            pipe.info("keyspace")
            return pipe.execute()

        found = self.call(read)
        if found is None:
            return None
        memory, keyspace = found
        space = keyspace.get(f"db{db}") or {}
        self._size = CacheSize(
            int(space.get("expires", 0)),
            int(memory.get("used_memory", 0)),
            int(memory.get("maxmemory", 0)),
            str(memory.get("maxmemory_policy", "")),
        )
        self._size_at = now
        self._warn_unless_evicting(self._size)
        return self._size

    def _warn_unless_evicting(self, size: CacheSize) -> None:
        if self._warned or (size.maxmemory > 0 and size.policy in EVICTING):
            return
        self._warned = True
        log.warning(
            "the cache Redis %s runs maxmemory %d with maxmemory-policy %s: nothing evicts the result cache's "
            "entries but their TTL, so it fills (then refuses writes: misses, not errors); run it with a "
            "maxmemory and maxmemory-policy allkeys-lru",
            self.address,
            size.maxmemory,
            size.policy,
        )


def redis_address(url: str) -> str:
    """A Redis URL without its password or user: what /v1/stats and the logs may show."""
    parts = urlsplit(url)
    host = parts.hostname or parts.path or "?"
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path if parts.hostname else ''}"


_planes: dict[tuple[str, int, float], CachePlane] = {}
_planes_lock = threading.Lock()


def cache_plane(settings: Settings) -> CachePlane | None:
    """The process's cache Redis (one for every cell it serves, so one circuit); None: the cache on the control plane.
    No function library there: its reads and writes are plain commands."""
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
            plane = CachePlane(client, redis_address(section.redis_url), section.retry_s)
            plane.size()  # its policy checked at the start (away now: at the first size read that answers)
            _planes[key] = plane
        return _planes[key]
