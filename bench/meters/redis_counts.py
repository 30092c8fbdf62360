"""What the control plane's Redis did per image over a run: commands (by name) and, where it has replicas, the
bytes of its replication stream, from INFO before and after (`bench ab` prints them beside the CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

# Commands a run's counts leave out: those that measuring them (INFO) issues.
_OWN = frozenset({"info"})


@dataclass(frozen=True)
class RedisCounts:
    commands: dict[str, int] = field(default_factory=dict)  # calls so far, by command
    usec: dict[str, int] = field(default_factory=dict)  # µs spent in each so far (a script's includes its calls')
    repl_offset: int = 0  # master_repl_offset: bytes written to the replication stream so far (0: no replicas)
    aof_rewrites: int = 0  # rewrites of the append-only file so far (each a fork writing the whole dataset)


def read_counts(port: int | None) -> RedisCounts | None:
    """The counts of the Redis on `port` now; None when there is none to ask or it does not answer."""
    if port is None:
        return None
    try:
        client = redis.Redis(port=port, socket_timeout=2.0)
        stats: dict[str, Any] = client.info("commandstats")
        replication: dict[str, Any] = client.info("replication")
        persistence: dict[str, Any] = client.info("persistence")
    except redis.RedisError:
        return None
    commands = {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}
    usec = {name.removeprefix("cmdstat_"): int(value["usec"]) for name, value in stats.items()}
    return RedisCounts(
        commands, usec, int(replication.get("master_repl_offset", 0)), int(persistence.get("aof_rewrites", 0))
    )


def per_image(before: RedisCounts | None, after: RedisCounts | None, images: int) -> dict[str, Any] | None:
    """Commands per image, in all and the most-called ten, the µs of the costliest ten, replication bytes per
    image and the append-only file's rewrites over the run; None when either
    reading is missing or a failover moved the primary between them (its counts start again)."""
    if before is None or after is None or images <= 0 or after.repl_offset < before.repl_offset:
        return None
    calls = {
        name: after.commands.get(name, 0) - before.commands.get(name, 0) for name in after.commands if name not in _OWN
    }
    calls = {name: n for name, n in calls.items() if n > 0}
    top = sorted(calls.items(), key=lambda item: -item[1])[:10]
    usec = {name: after.usec.get(name, 0) - before.usec.get(name, 0) for name in calls}
    return {
        "commands": round(sum(calls.values()) / images, 1),
        "top": {name: round(n / images, 2) for name, n in top},
        # µs an image in each command (Redis's own commandstats; a script's time includes the commands it calls)
        "usec": {name: round(us / images, 1) for name, us in sorted(usec.items(), key=lambda item: -item[1])[:10]},
        "repl_kb": round((after.repl_offset - before.repl_offset) / images / 1024.0, 2),
        "aof_rewrites": after.aof_rewrites - before.aof_rewrites,
    }
