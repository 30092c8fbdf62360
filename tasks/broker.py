"""The CPU hop: how a job's Celery message is taken, held, acknowledged and given back, in one place.

What it promises. A message the API queued (contract.task_messages, in the transaction that stores the job) is
run to its end by some CPU worker, or its job ends by its deadline; a worker that dies, however it dies, has the
messages it held back on their queues within about a heartbeat (`celery.heartbeat_ttl_s`, 10 s), not kombu's
`visibility_timeout` (300 s). A message may be delivered twice: the claim lets one attempt push a frame
(contract.jobs.handoff), and a job past `queued` drops a late task.

How, and what each step costs the control plane's Redis (counted by tests/test_control_plane_cost.py and
tests/test_cpu_hop_take.py). This table is the one list of every way a message comes back:

| step | who | commands |
|---|---|---|
| queued | the API, with the job (contract.jobs.intake) | LPUSH, inside the job's MULTI |
| taken and held, under load | Channel's take (the library's `take_and_hold`), each poll | FCALL: RPOP, HSET |
| acked, under load | HeldQoS.ack, the task ended (task_acks_late): on the next take | HDEL, in that FCALL |
| taken, idle (a take found every queue empty) | kombu's consumer, until a message comes | BRPOP |
| held, idle | HeldQoS.append: the message and when, under the worker's own name (`Keys.celery_holds`) | HSET |
| acked, idle; or at a beat or a close | HeldQoS.flush_acks | HDEL |
| a child killed mid-task | Celery rejects it (task_reject_on_worker_lost) | WATCH HGET MULTI HDEL LPUSH EXEC |
| a clean stop | kombu's restore at shutdown, through the holds | the same with RPUSH, a message |
| a worker found dead | given_back.reap_dead_workers, each live worker's beat (tasks.liveness) | HKEYS, as above |
| a lost ack or delivery (failover) | given_back.restore_unheld: held here, in no task's hands 10 s | the same |
| lost between an idle BRPOP and HSET | tasks.lost_deliveries: a `queued` job's message nowhere twice | RPUSH |

Under load an image costs the hop one round trip (the take, carrying the ack of the task before it) where BRPOP,
HSET and HDEL were three; a take brings up to the consumer's prefetch credit (TAKE_AT_MOST). An ack waits for the
next take only while one is coming: an idle worker deletes at once, and the beat and a close flush what waits (a
worker killed with an ack waiting has that message sent again by the reaper: the claim drops it as a late task).
A take pops and holds in one step, so no message is in a worker's hands unrecorded; only an idle worker's BRPOP
still has that window. Every take names one list a queue (`priority_steps: [0]`: no task is sent a priority).

Kombu's own ack emulation (its `unacked` hash and index: MULTI ZADD HSET EXEC, then MULTI ZREM HDEL EXEC, and this
module's set of each worker's tags beside them: 10 commands a task) is gone (issue 58); a message a worker of the
release before this one held there still comes back through kombu's restore after the visibility timeout.

Kombu builds a new redis-py client for every synchronous operation (each publish, each ack, each event flush): a
client's constructor copies ~170 response callbacks, about a quarter of a millisecond, several times per task in
the CPU worker's main process. A client holds no connection of its own (it borrows one from the channel's pool per
command), so one per channel serves every operation. The asynchronous client (the consumer's BRPOP, which keeps
its connection) is left as kombu makes it.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import kombu.transport as kombu_transport
import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from contract.clock import now as service_now
from contract.keys import CELERY_HOLDS
from contract.library import Step, is_missing

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.taken_held: set[str] = set()  # tags a take recorded as held already: their append writes nothing
        self.acks: list[str] = []  # acknowledged, their holds still to delete: on the next take, or flush_acks

    @property
    def holds_key(self) -> str:
        # Kombu's prefixing client adds its global_keyprefix to the key.
        return CELERY_HOLDS + holder_id()

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.taken_held:
            self.taken_held.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
            return
        delivery = message.delivery_info
        held = kombu_redis.dumps([message._raw, delivery["exchange"], delivery["routing_key"], service_now()])
        with self.channel.conn_or_acquire() as client:
            client.hset(self.holds_key, delivery_tag, held)
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self.acks.append(delivery_tag)
        if not self.channel.takes_next():  # idle: no take is coming soon to carry it
            self.flush_acks()
        virtual.QoS.ack(self, delivery_tag)

    def flush_acks(self) -> None:
        """Delete the holds of what was acknowledged and no take has carried yet. Not known to be deleted (Redis
        away), they stay to be deleted next time: an HDEL twice is once."""
        tags, self.acks = self.acks, []
        if not tags:
            return
        try:
            with self.channel.conn_or_acquire() as client:
                client.hdel(self.holds_key, *tags)
        except BaseException:
            self.acks[:0] = tags
            raise

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


# The library's `take_and_hold` (contract/library/cpu_hop.lua, where its keys and arguments are named).
_TAKE = Step("take_and_hold")
TAKE_AT_MOST = 8  # messages one take may bring, within the consumer's prefetch credit


class Channel(kombu_redis.Channel):
    QoS = HeldQoS
    _sync_client: Any = None
    # Under load the consumer's next poll is a take (one FCALL: pop, hold, and the acks since the last take); a take
    # that finds every queue empty turns it to kombu's BRPOP until a message comes.
    _taking = True
    _sent = ""  # what the poll in flight is: "take" or "BRPOP"
    _take_acks: list[str] = []  # the acks the take in flight carries

    def takes_next(self) -> bool:
        """Whether a take is coming soon that will carry an ack: this channel consumes, under load."""
        return self._taking and bool(self.active_queues) and not self._closing

    def _take_call(self, queues: list[str], most: int) -> tuple[list[str], list[Any]]:
        prefix = self.global_keyprefix or ""
        keys = [prefix + self.qos.holds_key]
        keys += [prefix + self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        self._take_acks, self.qos.acks = self.qos.acks, []
        return keys, [repr(service_now()), most, *self._take_acks]

    def _taken(self, reply: list[Any]) -> list[tuple[str, dict[str, Any]]]:
        """(queue, message) of what a take brought; those it held are marked so that their append writes nothing."""
        prefix, taken = self.global_keyprefix or "", []
        for position in range(0, len(reply), 3):
            key, item, held = reply[position : position + 3]
            message = kombu_redis.loads(kombu_redis.bytes_to_str(item))
            if held:
                self.qos.taken_held.add(message["properties"]["delivery_tag"])
            taken.append((kombu_redis.bytes_to_str(key)[len(prefix) :].rsplit(self.sep, 1)[0], message))
        return taken

    def _give_back_acks(self) -> None:
        # A take that failed: its acks are not known to have reached Redis; the next take or flush carries them.
        self.qos.acks[:0] = self._take_acks
        self._take_acks = []

    def _brpop_start(self, timeout: Any = None) -> None:
        if not self._taking:
            try:
                self.qos.flush_acks()  # idle: acks do not wait for a take
            except redis.RedisError:
                pass  # kept; the BRPOP below meets the same trouble and the consumer reconnects
            self._sent = "BRPOP"
            return super()._brpop_start(timeout)
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return None
        most = min(TAKE_AT_MOST, max(1, self.qos.can_consume_max_estimate() or 1))
        keys, args = self._take_call(queues, most)
        self._in_poll = self.client.connection
        self._brpop_sent_at = kombu_redis.monotonic()  # type: ignore[assignment]  # kombu's own, typed None
        self._sent = "take"
        self.client.connection.send_command("FCALL", _TAKE.name, len(keys), *keys, *args)
        return None

    def _brpop_read(self, **options: Any) -> bool:
        if self._sent != "take":
            delivered = super()._brpop_read(**options)  # raises Empty when BRPOP timed out
            self._taking = True  # a message came: the next poll takes
            return bool(delivered)
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "FCALL", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # as kombu's BRPOP: the next poll reconnects
                self._give_back_acks()
                raise
            except redis.ResponseError as error:
                self._give_back_acks()
                if not is_missing(error):
                    raise
                with self.conn_or_acquire() as client:  # a Redis that came back empty: the library, then again
                    _TAKE.recover(client)
                raise kombu_redis.Empty() from None
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu's own, typed bool
            self._flush_brpop_reauth()
        self._take_acks = []
        if not reply:
            self._taking = False
            raise kombu_redis.Empty()
        for queue, message in self._taken(reply):
            self._queue_cycle.rotate(queue)
            self.connection._deliver(message, queue)
        return True

    def _get(self, queue: str, timeout: Any = None) -> Any:
        # basic_get: one message, by the same step.
        with self.conn_or_acquire() as client:
            keys, args = self._take_call([queue], 1)
            try:
                reply = _TAKE(client, keys, args)
            except redis.RedisError:
                self._give_back_acks()
                raise
        self._take_acks = []
        if not reply:
            raise kombu_redis.Empty()
        return self._taken(reply)[0][1]

    def close(self) -> None:
        if self._qos is not None and not self._closing:
            try:
                self.qos.flush_acks()
            except redis.RedisError:
                pass  # the holds stay: given back, and dropped as late tasks, when this worker is found gone
        super().close()

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


def legacy_unacked_key(channel: Any) -> str:
    """Kombu's unacked hash, where a worker of the release before issue 58 left what it held, with its key prefix."""
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
