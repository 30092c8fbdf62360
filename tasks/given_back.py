"""The CPU hop's ways back that act on a worker's holds from outside kombu's loop, run at each live worker's beat
(tasks.liveness): a dead worker's messages, and a live one's that a failover's lost ack or delivery left recorded as
held. Every way a message comes back, these among them, is listed in one place: tasks.broker's module note."""

from __future__ import annotations

import json
from typing import Any, cast

import redis

from contract.keys import CELERY_HOLDS, Keys
from contract.library import Step


def held_since(client: redis.Redis, holds_key: str) -> dict[str, float]:
    """{delivery tag: when it was delivered} of what one worker holds (`holds_key` with Celery's key prefix)."""
    held = cast(dict[bytes, bytes], client.hgetall(holds_key))
    return {tag.decode(): float(json.loads(value)[-1]) for tag, value in held.items()}


# The library's `may_reap_cpu_worker` (contract/library/cpu_hop.lua, where its keys and arguments are named).
_MAY_REAP = Step("may_reap_cpu_worker")
REAP_LOCK_S = 30


def reap_dead_workers(client: redis.Redis, keys: Keys, me: str, restore: Any) -> dict[str, int]:
    """Give back the messages of every registered worker whose heartbeat lapsed: {worker: messages}.
    `restore(holds_key, tag)` puts one held message back on its queue (tasks.broker's HeldQoS.restore_held; the
    key without Celery's prefix, which kombu's client adds)."""
    reaped: dict[str, int] = {}
    for raw in cast(list[bytes], client.zrange(keys.cpu_workers, 0, -1)):
        holder = raw.decode()
        if holder == me or not _MAY_REAP(
            client, [keys.cpu_heartbeat(holder), keys.cpu_reaping(holder)], [me, REAP_LOCK_S]
        ):
            continue
        tags = [tag.decode() for tag in cast(list[bytes], client.hkeys(keys.celery_holds(holder)))]
        for tag in tags:
            restore(CELERY_HOLDS + holder, tag)
        pipe = client.pipeline(transaction=True)
        pipe.delete(keys.celery_holds(holder), keys.cpu_reaping(holder))
        pipe.zrem(keys.cpu_workers, holder)
        pipe.execute()
        reaped[holder] = len(tags)
    return reaped


# A message recorded as this worker's for longer than this, that no task of its holds, is given back: recorded
# after its delivery, it is in hand within milliseconds.
UNHELD_GRACE_S = 10.0


def restore_unheld(client: redis.Redis, keys: Keys, me: str, channel: Any, in_hand: set[str], now: float) -> int:
    """Give back the messages recorded as held by this live worker that none of its tasks holds: a failover
    to a replica that missed their ack (the task ended, its message still 'unacked' on the new primary), or
    missed the delivery's reply (the worker never got it). Kombu would give them back only after
    visibility_timeout (300 s), past any job's deadline; the reaper gives back only dead workers'. Returns how
    many went back to their queues."""
    channel.qos.flush_acks()  # what ended here: out of the holds, not taken for lost
    held = held_since(client, keys.celery_holds(me))
    restored = 0
    for tag, delivered_at in held.items():
        if tag in in_hand or tag in channel.qos.acks or delivered_at > now - UNHELD_GRACE_S:
            continue  # in hand, or delivered a moment ago: its task may not be in hand yet
        channel.qos.restore_held(CELERY_HOLDS + me, tag)  # back on its queue, out of the hash
        restored += 1
    return restored
