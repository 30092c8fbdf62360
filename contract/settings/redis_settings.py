"""The settings of how every process reaches Redis: the control plane's server (or the Sentinels that name it)
and what a `202` waits for, and the bulk shards that may hold uploads and frames. Part of contract.settings'
`Settings` (its `redis` and `bulk` sections); kept apart as the one concept they are.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from contract.settings.sections import SettingsError, settings_class


@settings_class
class BulkSettings:
    """Where uploads and frames live (contract.redis.shards). None listed: in the Redis of `redis_url`, beside the
    job records and everything else. Listed: spread over these Redis servers by a hash of the job id, while
    the control plane (job records, Celery, heartbeats, budgets, the cache) stays at `redis_url`."""

    redis_urls: tuple[str, ...] = ()
    # A shard unreachable this long: the live jobs whose bytes it held end `failed` (shard_unavailable).
    grace_s: float = 5.0
    retry_s: float = 1.0  # a process that found a shard down sends it nothing for this long

    def __post_init__(self) -> None:
        if self.grace_s <= 0 or self.retry_s <= 0:
            raise SettingsError("bulk.grace_s and bulk.retry_s must be > 0")
        if len(set(self.redis_urls)) != len(self.redis_urls):
            raise SettingsError("bulk.redis_urls: a shard is listed twice")


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@settings_class
class RedisSettings:
    """How every process finds the control plane's Redis, and what a `202` waits for (contract.redis.connection).

    No `sentinels`: the server of `redis_url`, as it is. Sentinels listed: the primary they name for `service`,
    followed through failovers by every process (the API, the Celery workers and Flower, the GPU workers, the
    bench); `redis_url` then gives only the password and the database. Bulk shards stay plain servers."""

    sentinels: tuple[str, ...] = ()  # "host:port" of each Sentinel (three or more: a majority elects)
    service: str = "imgserve"  # the primary's name at the Sentinels (`sentinel monitor <service> ...`)
    sentinel_password: str = ""  # the Sentinels' own (their requirepass): IMGSERVE_REDIS__SENTINEL_PASSWORD
    # A 202 waits (Redis WAIT, on the connection that stored the job) until this many replicas acknowledged
    # the job's record, upload and task, for at most replica_timeout_ms; fewer: the job is withdrawn and the
    # answer is 503 (retry). -1: 1 with sentinels listed, 0 (no wait) without. With Sentinels, every replica
    # they see up is waited for, never fewer than this (contract.redis.replication), and a read that shows how a job
    # ended waits the same way.
    min_replicas: int = -1
    replica_timeout_ms: int = 1000
    # With Sentinels: the API asks every one which server is the primary and which replicas are up this often,
    # each bounded by sentinel_timeout_ms; with no majority's answer for view_stale_ms nothing is promised (503).
    view_refresh_ms: int = 500
    view_stale_ms: int = 2000
    sentinel_timeout_ms: int = 300
    # Connecting to Redis, and waiting for a free connection of a bounded pool, at most this long (every process):
    # a down Redis answers 503 within it. Was `api.redis_timeout_s`, still read for one release (RENAMED).
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for address in self.sentinels:
            if not _HOST_PORT.match(address):
                raise SettingsError(f"redis.sentinels: {address!r} is not host:port")
        if len(set(self.sentinels)) != len(self.sentinels):
            raise SettingsError("redis.sentinels: a Sentinel is listed twice")
        if not self.service:
            raise SettingsError("redis.service: the name the Sentinels monitor the primary by")
        if self.min_replicas < -1 or self.replica_timeout_ms < 1:
            raise SettingsError("redis.min_replicas must be >= -1 (-1: the default) and replica_timeout_ms >= 1")
        if min(self.view_refresh_ms, self.sentinel_timeout_ms) < 1 or self.view_stale_ms <= self.view_refresh_ms:
            raise SettingsError(
                "redis.view_refresh_ms and sentinel_timeout_ms must be >= 1, and view_stale_ms above view_refresh_ms"
            )

    @property
    def replicas_per_write(self) -> int:
        """How many replicas a 202 waits for (min_replicas, its default resolved)."""
        return self.min_replicas if self.min_replicas >= 0 else (1 if self.sentinels else 0)

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        found = []
        for address in self.sentinels:
            match = _HOST_PORT.match(address)
            assert match is not None  # checked above
            found.append((match.group(1).strip("[]"), int(match.group(2))))
        return found


# Settings that moved, read under their old names for one release (docs/upgrading.md): (section, key) -> the new.
RENAMED = {
    ("api", "redis_timeout_s"): ("redis", "timeout_s"),
    ("cache", "hit_bytes_per_key"): ("jobs", "answer_bytes_per_key"),
}


def renamed_settings(layer: dict[str, Any], where: str) -> dict[str, Any]:
    """One layer of the settings (a file, or the environment's) with each RENAMED old name read as its new one, and
    a FutureWarning (Python's deprecation warning for users: shown by default) naming both; where the layer gives
    both names, the new one's value stands."""
    for (section, key), (new_section, new_key) in RENAMED.items():
        old = layer.get(section)
        if not isinstance(old, dict) or key not in old:
            continue
        old = dict(old)
        value = old.pop(key)
        new = dict(layer.get(new_section) or {})
        new.setdefault(new_key, value)
        layer = {**layer, section: old, new_section: new}
        variable = f"IMGSERVE_{new_section.upper()}__{new_key.upper()}"
        warnings.warn(
            f"{section}.{key} ({where}) is deprecated, read as {new_section}.{new_key} until the next release: "
            f"set {new_section}.{new_key} ({variable} in the environment) instead",
            FutureWarning,
            stacklevel=3,
        )
    return layer
