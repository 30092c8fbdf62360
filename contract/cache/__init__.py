"""The result cache: a repeated image costs one lookup, not a CPU task and a GPU slot.

An entry is a succeeded job's result document, keyed by a digest of the image's bytes, the model version's
spec (its file, size, layout, labels and default thresholds), the options that change the answer (conf, iou,
max_det, as applied) and the scope (the API key, unless cache.shared). The API looks up before queuing, in
one step that on a hit stores the job over already and on a miss admits it (contract.jobs.intake's
JobIntake.answer_or_admit). The step that ends a job `succeeded` stores its entry (the library's remember_all,
inside finish_jobs), so only answers that stood are cached: never a failure, an expiry, a cancellation or a
late answer. Entries are charged their document's bytes plus ENTRY_OVERHEAD against cache.max_bytes; past
it the least recently used go, in the same step, so the total never exceeds it and nothing but cache entries
is ever evicted. docs/operations.md has the why.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import redis
from blake3 import blake3

from contract.redis.keys import Keys

if TYPE_CHECKING:
    from contract.cache.cache_plane import CachePlane
from contract.settings import Settings
from contract.settings.models import ModelSpec

# What an entry costs beyond its document: its key, its LRU member and size field (Redis's own overhead).
ENTRY_OVERHEAD = 200
HIT, MISS = "hit", "miss"
CacheVerdict = Literal["hit", "miss"]
_VERSION = b"imgserve-result-cache-2\0"  # bump when what a digest covers changes: old entries then miss


@dataclass(frozen=True)
class CacheLimits:
    """What the step that ends jobs needs to store entries: where, how many bytes in all, how long."""

    prefix: str
    max_bytes: int = 0  # 0: store nothing
    ttl_s: int = 3600
    apart: bool = False  # on a cache Redis of its own (contract.cache.cache_plane): the batch write returns the entries

    @classmethod
    def of(cls, settings: Settings, keys: Keys) -> CacheLimits:
        return cls(keys.cache_prefix, settings.cache.max_bytes, settings.cache.ttl_s, bool(settings.cache.redis_url))

    def finish_names(self) -> list[Any]:
        """The arguments the library's cache_names reads (after contract.jobs.ending's own). Apart (and storing):
        max_bytes -1, so the control plane stores nothing and write_batch returns what to store elsewhere."""
        return [self.prefix, -1 if self.apart and self.max_bytes > 0 else self.max_bytes, self.ttl_s]


# The library's remember_all (contract/library/cache.lua), called by finish_jobs with the jobs it ended, stores each
# one's result if it ended `succeeded` and carries a `cache_key`; then STALE_PER_ENTRY entries unused past their TTL
# lose their books with every entry stored, so the two bookkeeping keys hold no more than the TTL's worth.
STALE_PER_ENTRY = 2  # more than the one a stored entry may later leave: the stale ones never pile up


def spec_fingerprint(spec: ModelSpec) -> bytes:
    """What of a model version decides its answers, as bytes: every field of its spec (a changed default
    threshold, input size or file path is another fingerprint; new weights under the same path and version
    are not: give them a new version)."""
    return hashlib.sha256(repr(spec).encode()).digest()


def effective_options(spec: ModelSpec, options: Mapping[str, Any]) -> tuple[float, float, int]:
    """conf, iou and max_det as the GPU worker applies them: an unset option is the model's default."""
    return (
        float(options.get("conf", spec.conf)),
        float(options.get("iou", spec.iou)),
        int(options.get("max_det", spec.max_det)),
    )


class MissCounts:
    """A process's cache misses, counted here and added to the shared counters (`Keys.cache_stats`) at most once
    a second (the API's sweeper tick) in one HINCRBY a model: one command an image less on the control plane, the
    miss being nearly every lookup. /v1/stats sees them up to a second late; a process killed before
    its flush loses at most that second's count (a statistic: no job depends on it). Hits stay counted in the
    hit's own step."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, model_key: str) -> None:
        with self._lock:
            self._counts[model_key] += 1

    def flush(self, client: redis.Redis, stats_key: str) -> int:
        """Add the counted misses to `stats_key`'s `<model>:misses` fields; kept for the next flush if Redis does
        not answer. How many were added."""
        with self._lock:
            pending, self._counts = self._counts, Counter()
        if not pending:
            return 0
        pipe = client.pipeline(transaction=False)
        for model_key, misses in pending.items():
            pipe.hincrby(stats_key, f"{model_key}:misses", misses)
        try:
            pipe.execute()
        except redis.RedisError:
            with self._lock:
                self._counts.update(pending)
            raise
        return sum(pending.values())


class ResultCache:
    """The API's side of the cache: digests and figures. The lookup, a hit's job stored over already and a miss's
    admission are one step (contract.jobs.intake's JobIntake.answer_or_admit); the GPU worker's batch write stores the
    entries."""

    def __init__(self, client: redis.Redis, keys: Keys, settings: Settings, plane: CachePlane | None = None) -> None:
        """`plane`: the cache's own Redis (contract.cache.cache_plane); None: the cache on `client`'s control plane."""
        self.redis, self.keys, self.settings, self.plane = client, keys, settings, plane
        self._fingerprints = {spec.key: spec_fingerprint(spec) for spec in settings.models}

    def enabled_for(self, spec: ModelSpec) -> bool:
        return self.settings.caches(spec)

    def digest(self, image: bytes | memoryview, spec: ModelSpec, options: Mapping[str, Any], scope: str) -> str:
        """BLAKE3 of the image (one thread, SIMD: the cheapest of the digests tried,
        docs/benchmarks/2026-12-03-result-cache.md) with the model's fingerprint, the options as applied and the scope
        (the API key id, "" if shared)."""
        conf, iou, max_det = effective_options(spec, options)
        outer = blake3(_VERSION)
        outer.update(blake3(image).digest())
        outer.update(self._fingerprints.get(spec.key) or spec_fingerprint(spec))
        outer.update(f"\0{conf!r}\0{iou!r}\0{max_det}\0".encode())
        outer.update(("" if self.settings.cache.shared else scope).encode())
        return outer.hexdigest()

    def stats(self, model_keys: Sequence[str]) -> dict[str, Any]:
        """Hits, misses and the hit rate per model; entries and bytes charged in all, against the budget. On a cache
        Redis of its own, no books: `entries` its keys with a TTL and `bytes` its used_memory, from its INFO read at
        most once a second (contract.cache.cache_plane's CachePlane.size), `maxmemory` its own; away: zeros, and
        `available` false."""

        def read(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(self.keys.cache_stats)
            if self.plane is None:
                pipe.zcard(self.keys.cache_lru)
                pipe.get(self.keys.cache_bytes)
            return pipe.execute()

        read_there = read(self.redis) if self.plane is None else self.plane.call(read)
        counts, entries, charged = ({}, 0, 0) if read_there is None else (*read_there, 0, 0)[:3]
        size = self.plane.size() if self.plane is not None and read_there is not None else None
        if size is not None:
            entries, charged = size.entries, size.used_bytes
        counts = dict(counts)
        per_model = {}
        for key in model_keys:
            hits, misses = int(counts.get(f"{key}:hits".encode(), 0)), int(counts.get(f"{key}:misses".encode(), 0))
            per_model[key] = {
                "hits": hits,
                "misses": misses,
                "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            }
        return {
            "enabled": self.settings.cache.enabled,
            "shared": self.settings.cache.shared,
            "entries": int(entries),
            "bytes": int(charged or 0),
            "max_bytes": self.settings.cache.max_bytes,
            "ttl_s": self.settings.cache.ttl_s,
            "models": per_model,
            "redis": self.plane.address if self.plane else None,
            "maxmemory": size.maxmemory if size is not None else None,
            "available": read_there is not None,
        }
