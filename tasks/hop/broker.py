"""The CPU hop: how a job's Celery message is taken, held, acknowledged and given back, in one place.

What it promises. A message the API queued (contract.jobs.task_messages, in the transaction that stores the job) is
run to its end by some CPU worker, or its job ends by its deadline; a worker that dies, however it dies, has the
messages it held back on their queues within about a heartbeat (`celery.heartbeat_ttl_s`, 10 s), not kombu's
`visibility_timeout` (300 s). A message may be delivered twice: the claim lets one attempt push a frame
(contract.jobs.handoff), and a job past `queued` drops a late task.

How, and what each step costs the control plane's Redis (counted by tests/test_control_plane_cost.py and
tests/test_cpu_hop_take.py). This table is the one list of every way a message comes back:

| step | who | commands |
|---|---|---|
| queued | the API, with the job (contract.jobs.intake) | LPUSH, inside the job's MULTI |
| taken and held, under load | Channel's take, each poll: into the worker's list (`Keys.celery_held`) | LMOVE |
| acked, under load | HeldQoS.ack, the task ended (task_acks_late): in the next take's pipeline | LREM |
| taken, idle (a take found every queue empty) | kombu's consumer, until a message comes | BRPOP |
| held, idle | HeldQoS.append: the message and when, in the worker's hash (`Keys.celery_holds`) | HSET |
| acked, idle; or at a beat or a close | HeldQoS.flush_acks | LREM or HDEL |
| a child killed mid-task | Celery rejects it (task_reject_on_worker_lost) | WATCH LPOS MULTI LREM LPUSH EXEC |
| a clean stop | kombu's restore at shutdown; a take's spare (beyond the credit) at close | the same, RPUSH |
| a worker found dead | given_back.reap_dead_workers, each worker's beat (tasks.hop.recovery) | LRANGE HKEYS, above |
| a lost ack or delivery (failover) | given_back.restore_unheld: held here, seen in no task's hands 10 s | the same |
| lost between an idle BRPOP and HSET | tasks.hop.lost_deliveries: a `queued` job's message nowhere twice | RPUSH |

Under load an image costs the hop one round trip (the take: LREMs of the acks since the last take, then an LMOVE a
queue, one pipeline) where BRPOP, HSET and HDEL were three. LMOVE takes and holds in one atomic step: no message is
in a worker's hands unrecorded (only an idle worker's BRPOP still has that window, tasks.hop.lost_deliveries' case). A
take moves up to the consumer's prefetch credit (TAKE_AT_MOST), and one from each queue at least; what it brings
beyond the credit is held already and waits for the next poll. A held list keeps no delivery time: a dead worker is
known by its heartbeat, not by its messages' age, and restore_unheld times what it finds by its own first sighting.
An ack waits for the next take only while one is coming: an idle worker deletes at once, and the beat and a close
flush what waits (a worker killed with an ack waiting has that message sent again: the claim drops it as a late
task). Every take names one list a queue (`priority_steps: [0]`: no task is sent a priority). A message a worker
of 0.1.0 held in kombu's `unacked` hash comes back through kombu's restore.

A take carries one more read when a step of the consumer asks for it (TakeRider): the CPU worker's pause check
(tasks.hop.full_lists) reads the frame lists' depths there while a list is half full, instead of a round trip of its
own each check, so a busy worker's checks cost the control plane commands inside a pipeline, not round trips.

The only Lua on the control plane outside the library (contract/library) is kombu's and redis-py's own, none a step
of a job: redis-py's Lock release on `unacked_mutex`, and kombu's binding refresh (the remote-control queue's) and
sweep (each minute), as cached scripts they load again themselves when Redis has lost them; an outside check
counted 8 such calls and 3 loads at a worker's start, then one call a minute.

Kombu builds a new redis-py client (its response callbacks copied) for every synchronous operation; a
client borrows a connection from the channel's pool per command, so one per channel serves them all. The
asynchronous client (the consumer's poll, which keeps its connection) is left as kombu makes it.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any, Protocol

import kombu.transport as kombu_transport
import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from contract.redis.clock import now as service_now
from contract.redis.keys import CELERY_HELD, CELERY_HOLDS
from tasks.hop.given_back import restore_from_hash, restore_from_list

# Named in the Celery app's `broker_transport`; the broker URL stays redis://. With Sentinels (settings.redis),
# SENTINEL_TRANSPORT and sentinel:// URLs: the same channel, its pools from kombu's Sentinel channel.
TRANSPORT = "tasks.hop.broker:Transport"
SENTINEL_TRANSPORT = "tasks.hop.broker:SentinelTransport"

log = logging.getLogger(__name__)


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
    """Kombu's QoS, its ack emulation replaced by the holder's held list and hash (see the module's note)."""

    _legacy_restore = False  # True while kombu's restore_visible gives back what its own unacked hash holds

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.listed: dict[str, bytes] = {}  # tag -> the message as a take moved it into the held list
        self.acks: list[str] = []  # acknowledged, their holds still to delete: on the next take, or flush_acks
        self.unheld_since: dict[str, float] = {}  # tag -> when restore_unheld first saw it held and not in hand

    @property
    def holds_key(self) -> str:
        # Kombu's prefixing client adds its global_keyprefix to the key.
        return CELERY_HOLDS + holder_id()

    @property
    def held_key(self) -> str:
        """This worker's held list, with Celery's key prefix (LMOVE, LREM and LPOS are not among kombu's prefixed)."""
        return str(self.channel.global_keyprefix or "") + CELERY_HELD + holder_id()

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag not in self.listed:  # a take held it already; an idle BRPOP's message is held here
            delivery = message.delivery_info
            held = kombu_redis.dumps([message._raw, delivery["exchange"], delivery["routing_key"], service_now()])
            with self.channel.conn_or_acquire() as client:
                client.hset(self.holds_key, delivery_tag, held)
        virtual.QoS.append(self, message, delivery_tag)

    def ack_commands(self, tags: list[str]) -> list[tuple[Any, ...]]:
        """The commands that delete these tags' holds (an LREM each from the held list, one HDEL for the rest), with
        their keys unprefixed where kombu's client prefixes them (HDEL)."""
        commands: list[tuple[Any, ...]] = []
        hashed = []
        for tag in tags:
            raw = self.listed.pop(tag, None)
            if raw is None:
                hashed.append(tag)
            else:
                commands.append(("LREM", self.held_key, 1, raw))
        if hashed:
            commands.append(("HDEL", self.holds_key, *hashed))
        return commands

    def ack(self, delivery_tag: str) -> None:
        self.acks.append(delivery_tag)
        if not self.channel.takes_next():  # idle: no take is coming soon to carry it
            self.flush_acks()
        virtual.QoS.ack(self, delivery_tag)

    def flush_acks(self) -> None:
        """Delete the holds of what was acknowledged and no take has carried yet. Not known to be deleted (Redis
        away), they stay to be deleted next time: an HDEL or LREM twice is once."""
        tags, self.acks = self.acks, []
        if tags:
            self._delete_holds(tags)

    def _delete_holds(self, tags: list[str]) -> None:
        listed = {tag: self.listed[tag] for tag in tags if tag in self.listed}
        try:
            with self.channel.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=False)
                for command in self.ack_commands(tags):
                    pipe.execute_command(*command)
                pipe.execute()
        except BaseException:
            self.listed.update(listed)
            self.acks[:0] = tags
            raise

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.restore_by_tag(delivery_tag, leftmost=True)
        else:
            self._delete_holds([delivery_tag])
        virtual.QoS.ack(self, delivery_tag)

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False) -> None:
        if self._legacy_restore:
            super().restore_by_tag(tag, client, leftmost)
        elif tag in self.listed:
            self.restore_listed(self.held_key, self.listed.pop(tag), client, leftmost)
        else:
            self.restore_held(CELERY_HOLDS + holder_id(), tag, client, leftmost)

    def restore_held(self, holds_key: str, tag: str, client: Any = None, leftmost: bool = False) -> None:
        """One message of a worker's hash (this one's, or one found dead) back on its queue: given_back's."""
        restore_from_hash(self.channel, holds_key, tag, client, leftmost)

    def restore_listed(self, held_key: str, raw: bytes, client: Any = None, leftmost: bool = False) -> None:
        """One message of a worker's held list (with Celery's prefix) back on its queue: given_back's."""
        restore_from_list(self.channel, held_key, raw, client, leftmost)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        # Kombu's unacked hash holds only what a worker of the release before this one held: kombu's own restore.
        self._legacy_restore = True
        try:
            super().restore_visible(start, num, interval)
        finally:
            self._legacy_restore = False


TAKE_AT_MOST = 8  # messages one take may bring, within the consumer's prefetch credit


class TakeRider(Protocol):
    """Another of the consumer's reads that rides on each take: its commands go in the take's pipeline (after the
    moves) and its replies come back to it, so that a busy worker, which takes often, makes no round trip of its own
    for them (tasks.hop.full_lists: the frame lists' depths)."""

    def ride(self) -> list[tuple[Any, ...]]:
        """The commands to send with this take (none: nothing rides)."""

    def took(self, replies: list[Any]) -> None:
        """The replies to `ride`'s commands, in order, read with the take's (a command that failed: its error)."""


class Channel(kombu_redis.Channel):
    QoS = HeldQoS
    _sync_client: Any = None
    # Under load the consumer's next poll is a take (one pipeline: LREM the acks since the last take, LMOVE from each
    # queue into the held list); a take that finds every queue empty turns it to kombu's BRPOP until a message comes.
    _taking = True
    _sent = ""  # what the poll in flight is: "take" or "BRPOP"
    _take_acks: list[str] = []  # the acks the take in flight carries
    _take_listed: dict[str, bytes] = {}  # their held list entries, kept in case the take fails
    _take_replies = 0  # replies the take in flight has to read: its acks' commands, then its moves
    _moves: list[str] = []  # the queue of each of the take's LMOVEs, in order
    rider: TakeRider | None = None  # set by the consumer's step that rides (tasks.hop.full_lists)
    _riding = 0  # how many of the take in flight's replies are the rider's (the last ones)
    # Messages a take brought beyond the consumer's credit (it moves from each of its queues: a take over two with
    # credit for one may bring two). Held in the list already; delivered by the next poll, given back at a close.
    _spare: list[tuple[str, dict[str, Any]]] = []

    def takes_next(self) -> bool:
        """Whether a take is coming soon that will carry an ack: this channel consumes, under load."""
        return self._taking and bool(self.active_queues) and not self._closing

    def _give_back_acks(self) -> None:
        # A take that failed: its acks are not known to have reached Redis; the next take or flush carries them.
        self.qos.acks[:0] = self._take_acks
        self.qos.listed.update(self._take_listed)
        self._take_acks, self._take_listed = [], {}

    def spare_tags(self) -> set[str]:
        """The delivery tags of what this channel took and has not delivered yet (held, not in any task's hands)."""
        return {message["properties"]["delivery_tag"] for _, message in self._spare}

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
        most = min(TAKE_AT_MOST, max(1, self.qos.can_consume_max_estimate() or 1)) - len(self._spare)
        prefix = self.global_keyprefix or ""
        self._take_acks, self.qos.acks = self.qos.acks, []
        self._take_listed = {tag: self.qos.listed[tag] for tag in self._take_acks if tag in self.qos.listed}
        acks = self.qos.ack_commands(self._take_acks)
        commands = [(command, prefix + key if command == "HDEL" else key, *rest) for command, key, *rest in acks]
        # One move a queue at least (a queue left out would wait for an empty take and a BRPOP), the rest of the
        # credit from the first; none while what a take brought beyond the credit is still to be delivered.
        self._moves = [] if most <= 0 else [queues[0]] * max(1, most - len(queues) + 1) + queues[1:]
        for queue in self._moves:
            commands.append(("LMOVE", prefix + self._q_for_pri(queue, 0), self.qos.held_key, "RIGHT", "LEFT"))
        riding: list[tuple[Any, ...]] = []
        if self.rider is not None and commands:
            try:
                riding = self.rider.ride()
            except Exception:  # another step's read: the take goes without it, its acks in hand kept
                log.exception("a take's rider failed; the take goes without it")
        self._riding = len(riding)
        commands += riding
        self._take_replies = len(commands) + (0 if commands else 1)
        connection = self.client.connection
        self._in_poll = connection
        self._brpop_sent_at = kombu_redis.monotonic()  # type: ignore[assignment]  # kombu's own, typed None
        self._sent = "take"
        connection.send_packed_command(connection.pack_commands(commands or [("PING",)]))
        return None

    def _brpop_read(self, **options: Any) -> bool:
        if self._sent != "take":
            delivered = super()._brpop_read(**options)  # raises Empty when BRPOP timed out
            self._taking = True  # a message came: the next poll takes
            return bool(delivered)
        replies: list[Any] = []
        try:
            try:
                for _ in range(self._take_replies):  # every reply read, an error's too, before one is raised
                    try:
                        replies.append(self.client.parse_response(self.client.connection, "LMOVE", **options))
                    except redis.ResponseError as error:
                        replies.append(error)
            except self.connection_errors:
                self.client.connection.disconnect()  # as kombu's BRPOP: the next poll reconnects
                self._keep_moved(replies)  # the moves read before the loss are held: kept, not left to the grace
                self._give_back_acks()
                raise
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu's own, typed bool
            self._flush_brpop_reauth()
        if self._riding:
            replies, riders = replies[: -self._riding], replies[-self._riding :]
            if self.rider is not None:
                try:
                    self.rider.took(riders)  # its commands' errors are its own, and so is its code's: the take stands
                except Exception:  # raised on, what the take moved would wait held, delivered to no task
                    log.exception("a take's rider failed on its replies; the take stands")
        self._keep_moved(replies)
        errors = [reply for reply in replies if isinstance(reply, redis.ResponseError)]
        if errors:  # what moved is held and kept; the acks are not known to be done: carried again
            self._give_back_acks()
            raise errors[0]
        self._take_acks, self._take_listed = [], {}
        most = max(1, min(TAKE_AT_MOST, self.qos.can_consume_max_estimate() or 1))
        taken, self._spare = self._spare[:most], self._spare[most:]
        if not taken:
            self._taking = False
            raise kombu_redis.Empty()
        for queue, message in taken:
            self._queue_cycle.rotate(queue)
            self.connection._deliver(message, queue)
        return True

    def _keep_moved(self, replies: list[Any]) -> None:
        """What the take's moves brought (their replies, after the acks', as far as they were read): held in the
        list already, so kept with the spare, delivered by the next poll or given back at a close."""
        first = self._take_replies - self._riding - len(self._moves)
        spare = list(self._spare)
        for queue, item in zip(self._moves, replies[first : first + len(self._moves)]):
            if isinstance(item, bytes):
                message = kombu_redis.loads(kombu_redis.bytes_to_str(item))
                self.qos.listed[message["properties"]["delivery_tag"]] = item
                spare.append((queue, message))
        self._spare = spare

    def close(self) -> None:
        if self._qos is not None and not self._closing:
            try:
                self.qos.flush_acks()
                while self._spare:  # taken, never delivered: back on their queues now, not when found dead
                    _, message = self._spare[0]
                    tag = message["properties"]["delivery_tag"]
                    self.qos.restore_listed(self.qos.held_key, self.qos.listed.pop(tag, b""))
                    self._spare.pop(0)
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
            # the worker ("Unrecoverable error"). The messages stay held: tasks.hop.recovery or the visibility
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
