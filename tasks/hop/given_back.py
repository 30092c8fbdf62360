"""The CPU hop's ways back that act on a worker's holds from outside kombu's loop, run at each live worker's beat
(tasks.hop.recovery): a dead worker's messages, and a live one's that a failover's lost ack or delivery left recorded as
held. A worker's holds are two: its held list (`Keys.celery_held`, what its takes moved there under load) and its
hash (`Keys.celery_holds`, what an idle BRPOP brought, and everything a worker of the release before held); every
reader here reads both. Every way a message comes back is listed in one place: tasks.hop.broker's module note."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import redis
from kombu.transport import redis as kombu_redis

from contract.library import Step
from contract.redis.keys import CELERY_HOLDS, Keys


def restore_from_hash(channel: Any, holds_key: str, tag: str, client: Any = None, leftmost: bool = False) -> None:
    """Put one message of a worker's hash (`holds_key` without Celery's prefix, which kombu's client adds) back on
    its queue and out of the hash, in one transaction: a message restored twice goes back once."""

    def restore_transaction(pipe: Any) -> None:
        held = pipe.hget(holds_key, tag)
        pipe.multi()
        pipe.hdel(holds_key, tag)
        if held:
            message, exchange, routing_key, _ = kombu_redis.loads(kombu_redis.bytes_to_str(held))
            channel._do_restore_message(message, exchange, routing_key, pipe, leftmost)

    with channel.conn_or_acquire(client) as client:
        client.transaction(restore_transaction, holds_key)


def restore_from_list(channel: Any, held_key: str, raw: bytes, client: Any = None, leftmost: bool = False) -> None:
    """Put one message of a worker's held list (`held_key` with Celery's prefix: kombu's client does not prefix
    LPOS or LREM) back on the queue its delivery_info names and out of the list, in one transaction: restored
    twice, back once."""
    prefix = str(channel.global_keyprefix or "")

    def restore_transaction(pipe: Any) -> None:
        there = pipe.execute_command("LPOS", held_key, raw) is not None
        pipe.multi()
        pipe.execute_command("LREM", held_key, 1, raw)
        if there:
            message = kombu_redis.loads(kombu_redis.bytes_to_str(raw))
            delivery = message["properties"]["delivery_info"]
            channel._do_restore_message(message, delivery["exchange"], delivery["routing_key"], pipe, leftmost)

    with channel.conn_or_acquire(client) as client:
        client.transaction(restore_transaction, held_key.removeprefix(prefix))  # WATCH: kombu's client prefixes it


def listed_tags(client: redis.Redis, held_key: str) -> dict[str, bytes]:
    """{delivery tag: the message as it lies there} of one worker's held list."""
    listed = {}
    for raw in cast(list[bytes], client.lrange(held_key, 0, -1)):
        try:
            listed[json.loads(raw)["properties"]["delivery_tag"]] = raw
        except (ValueError, KeyError, TypeError):
            continue  # not a message kombu could read: no worker could have run it either
    return listed


def held_since(client: redis.Redis, holds_key: str) -> dict[str, float]:
    """{delivery tag: when it was delivered} of what one worker holds in its hash (`holds_key` with the prefix)."""
    held = cast(dict[bytes, bytes], client.hgetall(holds_key))
    return {tag.decode(): float(json.loads(value)[-1]) for tag, value in held.items()}


# The library's `may_reap_cpu_worker` (contract/library/cpu_hop.lua, where its keys and arguments are named).
_MAY_REAP = Step("may_reap_cpu_worker")
REAP_LOCK_S = 30


def reap_dead_workers(
    client: redis.Redis,
    keys: Keys,
    me: str,
    restore: Callable[[str, str], None],
    restore_listed: Callable[[str, bytes], None],
) -> dict[str, int]:
    """Give back the messages of every registered worker whose heartbeat lapsed: {worker: messages}. Dead is its
    heartbeat's word, not its messages' age (a held list keeps none). `restore(holds_key, tag)` puts one message of
    its hash back (HeldQoS.restore_held; the key without Celery's prefix), `restore_listed(held_key, message)` one
    of its held list (HeldQoS.restore_listed; the key with it)."""
    reaped: dict[str, int] = {}
    for raw in cast(list[bytes], client.zrange(keys.cpu_workers, 0, -1)):
        holder = raw.decode()
        if holder == me or not _MAY_REAP(
            client, [keys.cpu_heartbeat(holder), keys.cpu_reaping(holder)], [me, REAP_LOCK_S]
        ):
            continue
        listed = cast(list[bytes], client.lrange(keys.celery_held(holder), 0, -1))
        for message in listed:
            restore_listed(keys.celery_held(holder), message)
        tags = [tag.decode() for tag in cast(list[bytes], client.hkeys(keys.celery_holds(holder)))]
        for tag in tags:
            restore(CELERY_HOLDS + holder, tag)
        pipe = client.pipeline(transaction=True)
        pipe.delete(keys.celery_holds(holder), keys.celery_held(holder), keys.cpu_reaping(holder))
        pipe.zrem(keys.cpu_workers, holder)
        pipe.execute()
        reaped[holder] = len(listed) + len(tags)
    return reaped


# A message recorded as this worker's, that no task of its holds, for longer than this is given back: recorded
# as it is taken, it is in hand within milliseconds.
UNHELD_GRACE_S = 10.0


def restore_unheld(client: redis.Redis, keys: Keys, me: str, channel: Any, in_hand: set[str], now: float) -> int:
    """Give back the messages recorded as held by this live worker that none of its tasks holds: a failover
    to a replica that missed their ack (the task ended, its message still held on the new primary), or
    missed the delivery's reply (the worker never got it). Kombu would give them back only after
    visibility_timeout (300 s), past any job's deadline; the reaper gives back only dead workers'. A hash entry is
    timed by its delivery; a held list's entry (which keeps no time) by when this beat first saw it out of hand
    (`qos.unheld_since`, this process's memory: a restarted worker is another holder). Returns how many went back."""
    channel.qos.flush_acks()  # what ended here: out of the holds, not taken for lost
    qos, spare = channel.qos, channel.spare_tags()
    restored = 0
    for tag, delivered_at in held_since(client, keys.celery_holds(me)).items():
        if tag in in_hand or tag in qos.acks or delivered_at > now - UNHELD_GRACE_S:
            continue  # in hand, or delivered a moment ago: its task may not be in hand yet
        qos.restore_held(CELERY_HOLDS + me, tag)  # back on its queue, out of the hash
        restored += 1
    listed = listed_tags(client, keys.celery_held(me))
    qos.unheld_since = {tag: qos.unheld_since.get(tag, now) for tag in listed if tag not in in_hand | spare}
    for tag, seen in qos.unheld_since.items():
        if tag not in qos.acks and seen <= now - UNHELD_GRACE_S:
            qos.listed.pop(tag, None)
            qos.restore_listed(keys.celery_held(me), listed[tag])
            restored += 1
    return restored


def legacy_unacked_key(channel: Any) -> str:
    """Kombu's unacked hash, where a 0.1.0 worker left what it held, with its key prefix."""
    return str(channel.global_keyprefix or "") + str(channel.unacked_key)


def tags_in_hand() -> set[str]:
    """The delivery tags of the tasks this worker process has received and not finished."""
    from celery.worker import state

    tags = set()
    for request in list(state.reserved_requests):
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if tag is not None:
            tags.add(str(tag))
    return tags
