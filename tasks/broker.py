"""Kombu's Redis transport, with one synchronous Redis client per channel, and every message a worker
holds recorded under that worker's name.

Kombu builds a new redis-py client for every synchronous operation (each
publish, each ack, each event flush): a client's constructor copies ~170
response callbacks, about a quarter of a millisecond, several times per task
in the CPU worker's main process. A client holds no connection of its own (it
borrows one from the channel's pool per command), so one per channel serves
every operation. The asynchronous client (the consumer's BRPOP, which keeps its
connection) is left as kombu makes it.

Held messages. Kombu's ack emulation copies each delivered message into its
`unacked` hash and its time into an index (MULTI ZADD HSET EXEC), removes both
on the ack (MULTI ZREM HDEL EXEC), and gives a message back only once it is
`visibility_timeout` old (300 s; it cannot be shorter than the longest task).
Here a delivered message is written once, into its holding worker's own hash
(`Keys.celery_holds`: tag -> the message and when it was delivered, one HSET),
and the ack deletes it (one HDEL): 2 commands a task instead of 8 (issue 58).
The product's own redelivery does the rest, each case tested:
- a worker found dead (its heartbeat lapsed) has its hash given back at once
  (tasks.liveness's reaper);
- a live worker gives back what its hash holds and none of its tasks does (a
  failover lost the ack or the delivery: tasks.liveness.restore_unheld);
- a child killed mid-task: Celery rejects the message, which goes back to the
  front of its queue; a clean stop gives back what the worker held (kombu's
  restore at shutdown, through this hash);
- a worker killed between BRPOP and the HSET: tasks.lost_deliveries sends the
  job's task again;
- a message a worker of the release before this one held (in kombu's unacked
  hash) comes back through kombu's own restore after the visibility timeout.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from typing import Any, cast

import kombu.transport as kombu_transport
import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from contract.clock import now as service_now
from contract.keys import CELERY_HOLDS

# Named in the Celery app's `broker_transport`; the broker URL stays redis://. With Sentinels (settings.redis),
# SENTINEL_TRANSPORT and sentinel:// URLs: the same channel, its pools from kombu's Sentinel channel.
TRANSPORT = "tasks.broker:Transport"
SENTINEL_TRANSPORT = "tasks.broker:SentinelTransport"


def own_the_schemes() -> None:
    """Make kombu resolve redis:// and sentinel:// URLs to this module's transports in this process. Celery's
    `broker_transport` names the transport of the first connection only: on a failover kombu's Connection.switch
    takes the next URL's scheme as the transport, and a worker then went on with kombu's own (its held messages
    unrecorded; since the holds replaced kombu's unacked hash, its liveness failed)."""
    transports = {"redis": TRANSPORT, "sentinel": SENTINEL_TRANSPORT}
    kombu_transport.TRANSPORT_ALIASES.update(transports)
    for scheme in transports:
        kombu_transport._transport_cache.pop(scheme, None)  # resolved before this: resolved again


_holder = {"id": ""}


def holder_id() -> str:
    """This process's name as a holder of messages: host, pid and a random part (a restarted worker, even with
    the same pid in a new container, is someone else)."""
    if not _holder["id"] or not _holder["id"].split(":")[-2] == str(os.getpid()):
        _holder["id"] = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    return _holder["id"]


class HeldQoS(kombu_redis.QoS):
    """Kombu's QoS, its ack emulation replaced by the holder's hash (see the module's note)."""

    _legacy_restore = False  # True while kombu's restore_visible gives back what its own unacked hash holds

    @property
    def holds_key(self) -> str:
        # Kombu's prefixing client adds its global_keyprefix to the key.
        return CELERY_HOLDS + holder_id()

    def append(self, message: Any, delivery_tag: str) -> None:
        delivery = message.delivery_info
        held = kombu_redis.dumps([message._raw, delivery["exchange"], delivery["routing_key"], service_now()])
        with self.channel.conn_or_acquire() as client:
            client.hset(self.holds_key, delivery_tag, held)
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        with self.channel.conn_or_acquire() as client:
            client.hdel(self.holds_key, delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.restore_by_tag(delivery_tag, leftmost=True)
        else:
            with self.channel.conn_or_acquire() as client:
                client.hdel(self.holds_key, delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False) -> None:
        if self._legacy_restore:
            super().restore_by_tag(tag, client, leftmost)
        else:
            self.restore_held(CELERY_HOLDS + holder_id(), tag, client, leftmost)

    def restore_held(self, holds_key: str, tag: str, client: Any = None, leftmost: bool = False) -> None:
        """Put one message a worker holds (this one, or one found dead) back on its queue, and out of its hash,
        in one transaction: a message restored twice goes back once."""

        def restore_transaction(pipe: Any) -> None:
            held = pipe.hget(holds_key, tag)
            pipe.multi()
            pipe.hdel(holds_key, tag)
            if held:
                message, exchange, routing_key, _ = kombu_redis.loads(kombu_redis.bytes_to_str(held))
                self.channel._do_restore_message(message, exchange, routing_key, pipe, leftmost)

        with self.channel.conn_or_acquire(client) as client:
            client.transaction(restore_transaction, holds_key)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        # Kombu's unacked hash holds only what a worker of the release before this one held: kombu's own restore.
        self._legacy_restore = True
        try:
            super().restore_visible(start, num, interval)
        finally:
            self._legacy_restore = False


def held_since(client: redis.Redis, holds_key: str) -> dict[str, float]:
    """{delivery tag: when it was delivered} of what one worker holds (`holds_key` with Celery's key prefix)."""
    held = cast(dict[bytes, bytes], client.hgetall(holds_key))
    return {tag.decode(): float(json.loads(value)[-1]) for tag, value in held.items()}


class Channel(kombu_redis.Channel):
    QoS = HeldQoS
    _sync_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        if self._pool is None and self.connection.client is None:
            # The channel closes after its connection was lost (kombu let go of the connection first): no pool
            # can be made for what close() still does (putting unacked messages back). Said as a connection
            # error, which Celery's consumer ignores while it reconnects; kombu's own AttributeError stopped
            # the worker ("Unrecoverable error"). The messages stay held: tasks.liveness or the visibility
            # timeout gives them back.
            raise redis.ConnectionError("the broker connection is closing")
        client = self._sync_client
        if client is None or client.connection_pool is not self.pool:  # a reconnect makes a new pool
            client = self._sync_client = super()._create_client(asynchronous=False)
        return client

    def queue_delete(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().queue_delete(queue, *args, **kwargs)
        except redis.ConnectionError:
            if not self._closing:
                raise
            # Closing after Redis went away: the fanout binding close() tidies (gossip's, the control queue's)
            # stays, as it did when this raised; the close goes on and lets its pools go. Raised, it reached
            # Celery's ignore_errors on the connection the consumer had already dropped: an AttributeError
            # logged as "Error on restarting Gossip" on every Redis restart.
            return None


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """This module's channel (held messages, one synchronous client) whose pools connect to the primary the
    Sentinels name (kombu's SentinelChannel: `master_name` and `sentinel_kwargs` from the transport options)."""


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel
