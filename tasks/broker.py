"""Kombu's Redis transport, with one synchronous Redis client per channel, and every message a worker
holds recorded under that worker's name.

Kombu builds a new redis-py client for every synchronous operation (each
publish, each ack, each event flush): a client's constructor copies ~170
response callbacks, about a quarter of a millisecond, several times per task
in the CPU worker's main process. A client holds no connection of its own (it
borrows one from the channel's pool per command), so one per channel serves
every operation. The asynchronous client (the consumer's BRPOP, which keeps its
connection) is left as kombu makes it.

Held messages. Kombu keeps each delivered, unacknowledged message in its
`unacked` hash until it is acked, and gives it back to its queue only once it
is `visibility_timeout` old (300 s; it cannot be shorter than the longest task).
So a worker whose main process died stranded its tasks for minutes. Here the
same step that records a message as unacked also adds its delivery tag to the
holding worker's own set (`Keys.celery_held`), and the ack removes it: a
worker found dead (its heartbeat lapsed, tasks.liveness) has exactly those
messages given back at once.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from contract.clock import now as service_now
from contract.keys import CELERY_HELD

# Named in the Celery app's `broker_transport`; the broker URL stays redis://. With Sentinels (settings.redis),
# SENTINEL_TRANSPORT and sentinel:// URLs: the same channel, its pools from kombu's Sentinel channel.
TRANSPORT = "tasks.broker:Transport"
SENTINEL_TRANSPORT = "tasks.broker:SentinelTransport"


_holder = {"id": ""}


def holder_id() -> str:
    """This process's name as a holder of messages: host, pid and a random part (a restarted worker, even with
    the same pid in a new container, is someone else)."""
    if not _holder["id"] or not _holder["id"].split(":")[-2] == str(os.getpid()):
        _holder["id"] = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    return _holder["id"]


class HeldQoS(kombu_redis.QoS):
    """Kombu's ack emulation, with the holder's set kept in the same transactions (see the module's note)."""

    def append(self, message: Any, delivery_tag: str) -> None:
        delivery = message.delivery_info
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: service_now()}).hset(
                self.unacked_key,
                delivery_tag,
                kombu_redis.dumps([message._raw, delivery["exchange"], delivery["routing_key"]]),
            ).sadd(CELERY_HELD + holder_id(), delivery_tag).execute()
            virtual.QoS.append(self, message, delivery_tag)

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        with self.pipe_or_acquire(pipe) as pipe:
            return (
                pipe.zrem(self.unacked_index_key, delivery_tag)
                .hdel(self.unacked_key, delivery_tag)
                .srem(CELERY_HELD + holder_id(), delivery_tag)
            )


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
