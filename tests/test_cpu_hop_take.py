"""The CPU hop's take (tasks.hop.broker's Channel: one pipeline of LREM for the acks since the last take and LMOVE of
each queue into the worker's held list) as a consuming worker meets it, on a real Redis with the product's transport
and kombu's own poller (the loop a Celery worker's consumer runs): under load each poll is one round trip that
takes, holds and carries the acks; a take that finds nothing turns the worker to BRPOP, and what BRPOP brings turns
it back. Every reader of the holds (the reaper, restore_unheld, a reject, a close) reads the held list."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import kombu
import pytest
import redis

from bench.stack.processes import RedisServer
from contract.redis.keys import Keys
from tasks.hop.broker import TRANSPORT, holder_id
from tasks.hop.given_back import listed_tags, reap_dead_workers, restore_unheld

QUEUE = "take-q"
OTHER = "take-other"


@pytest.fixture
def worker(tmp_path) -> Iterator[tuple[Any, redis.Redis, Keys, kombu.Queue]]:
    """A kombu connection on a redis-server of this test's alone (INFO's counts are the whole server's)."""
    server = RedisServer(tmp_path)
    client = redis.Redis(port=server.port)
    keys = Keys("take")
    with kombu.Connection(
        f"redis://127.0.0.1:{server.port}/0",
        transport=TRANSPORT,
        transport_options={"global_keyprefix": keys.celery_prefix, "priority_steps": [0]},
    ) as connection:
        queue = kombu.Queue(QUEUE, kombu.Exchange(QUEUE, type="direct"), QUEUE)
        yield connection, client, keys, queue
    client.close()
    server.stop()


def publish(connection: Any, queue: kombu.Queue, *bodies: str) -> None:
    with connection.Producer() as producer:
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=QUEUE, declare=[queue])


def calls(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def drain_until(connection: Any, done: Any, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, "not done in time"
        try:
            connection.drain_events(timeout=0.2)
        except TimeoutError:
            pass


def held(client: redis.Redis, keys: Keys) -> set[str]:
    """The delivery tags in this worker's held list."""
    return set(listed_tags(client, keys.celery_held(holder_id())))


def bodies_on(client: redis.Redis, keys: Keys, queue: str) -> list[str]:
    return [json.loads(raw)["properties"]["delivery_tag"] for raw in client.lrange(keys.celery_queue(queue), 0, -1)]


def test_under_load_each_take_holds_what_it_brings_and_carries_the_acks_since_the_last(worker):
    connection, client, keys, queue = worker
    publish(connection, queue, *[f"task {n}" for n in range(6)])
    holds = keys.celery_holds(holder_id())
    seen: list[str] = []
    held_when_seen: list[bool] = []

    def on_message(body: str, message: Any) -> None:
        seen.append(body)
        held_when_seen.append(message.delivery_tag in held(client, keys))
        message.ack()  # a task that ended: its hold goes with the next take, not with a command of its own

    client.config_resetstat()
    with connection.Consumer(queue, callbacks=[on_message], prefetch_count=2):
        drain_until(connection, lambda: len(seen) == 6)
        assert seen == [f"task {n}" for n in range(6)]
        assert all(held_when_seen)  # held before its task began: no window between the pop and the hold
        counted = calls(client)
        # Six messages in takes of up to two (the prefetch credit), each a pipeline of LREMs (the acks since the
        # last take) and LMOVEs: no BRPOP while messages were queued, nothing in the hash, no script.
        assert counted.get("brpop", 0) == 0, counted
        assert counted["lmove"] >= 6 and counted["lmove"] <= 8 and "hset" not in counted, counted
        assert "fcall" not in counted and "hdel" not in counted, counted
        # The queue found empty: the take that found it so carried the last acks, and the worker waits in BRPOP.
        drain_until(connection, lambda: calls(client).get("brpop", 0) >= 1)
        assert calls(client)["lrem"] == 6 and held(client, keys) == set()
        publish(connection, queue, "after the lull")
        drain_until(connection, lambda: len(seen) == 7)
        drain_until(connection, lambda: client.hlen(holds) == 0)  # idle: held in the hash, the ack deleted at once
        assert calls(client)["hset"] == 1


def test_a_take_over_two_queues_stays_within_the_credit_and_a_close_gives_back_its_spare(worker):
    """Credit for one, a message on each of two queues: the take moves one from each (a queue left out would wait
    for an empty take and a BRPOP), delivers one, and keeps the other held for the next poll; a close puts what was
    never delivered back at the front of its queue, and kombu's restore what was."""
    connection, client, keys, queue = worker
    other = kombu.Queue(OTHER, kombu.Exchange(OTHER, type="direct"), OTHER)
    publish(connection, queue, "first")
    with connection.Producer() as producer:
        producer.publish("second", exchange=other.exchange, routing_key=OTHER, declare=[other])
    messages: list[Any] = []
    consumer = connection.Consumer([queue, other], callbacks=[lambda body, message: messages.append(message)])
    consumer.qos(prefetch_count=1)
    with consumer:
        drain_until(connection, lambda: len(held(client, keys)) == 2)
        for _ in range(3):  # polls with no credit left: nothing more delivered
            try:
                connection.drain_events(timeout=0.2)
            except TimeoutError:
                pass
        assert len(messages) == 1
        messages[0].ack()
        drain_until(connection, lambda: len(messages) == 2)  # the spare, on the poll after the ack
        assert held(client, keys) == {messages[1].delivery_tag}  # the ack rode on that poll
        assert client.llen(keys.celery_queue(QUEUE)) == client.llen(keys.celery_queue(OTHER)) == 0
        publish(connection, queue, "third")
        with connection.Producer() as producer:
            producer.publish("fourth", exchange=other.exchange, routing_key=OTHER, declare=[other])
        messages[1].ack()
        drain_until(connection, lambda: len(messages) == 3)
        channel = messages[0].channel
        assert len(channel.spare_tags()) == 1
        spare = next(iter(channel.spare_tags()))
        channel.qos.restore_unacked_once()  # a clean stop: kombu's restore, what was delivered
        channel.close()  # and the close, the spare
    assert held(client, keys) == set()
    back = bodies_on(client, keys, QUEUE) + bodies_on(client, keys, OTHER)
    assert sorted(back) == sorted([spare, messages[2].delivery_tag])


def test_a_held_message_that_no_task_holds_goes_back_after_its_grace_and_an_acknowledged_one_does_not(worker):
    """restore_unheld (a failover lost an ack or a delivery) reads the held list, which keeps no delivery time: a
    message is timed from the beat that first saw it out of any task's hands, so one just taken (not in hand yet)
    is not given back; an ack not yet carried by a take is flushed first, so its message is not taken for lost."""
    connection, client, keys, queue = worker
    publish(connection, queue, "done", "lost", "in hand")
    messages: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: messages.append(message)], prefetch_count=3):
        drain_until(connection, lambda: len(messages) == 3)
        channel = messages[0].channel
        messages[0].ack()
        assert held(client, keys) == {message.delivery_tag for message in messages}  # the ack not yet carried
        in_hand = {messages[2].delivery_tag}
        assert restore_unheld(client, keys, holder_id(), channel, in_hand, 1000.0) == 0  # first seen: timed now
        assert held(client, keys) == {messages[1].delivery_tag, messages[2].delivery_tag}  # the ack, flushed
        assert restore_unheld(client, keys, holder_id(), channel, in_hand, 1009.0) == 0  # within the grace
        assert restore_unheld(client, keys, holder_id(), channel, set(), 1010.5) == 1  # the lost one only
        assert held(client, keys) == {messages[2].delivery_tag}  # out of hand from 1010.5 on: timed from there
        assert bodies_on(client, keys, QUEUE) == [messages[1].delivery_tag]
        assert restore_unheld(client, keys, holder_id(), channel, set(), 1019.0) == 0


def test_a_dead_workers_held_list_and_hash_go_back_once(worker):
    """The reaper gives back both forms of a dead worker's holds: its held list (this release's take) and its hash
    (an idle BRPOP's hold, and all a worker of the release before held: a rolling upgrade loses neither); a reaper
    cut short and run again gives nothing back twice."""
    connection, client, keys, queue = worker
    publish(connection, queue, "taken under load", "taken idle")
    messages: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: messages.append(message)], prefetch_count=1):
        drain_until(connection, lambda: len(messages) == 1)
        channel = messages[0].channel
        idle = queue(channel).get(no_ack=False)  # basic_get: kombu's RPOP, held in the hash
        assert idle is not None and client.hexists(keys.celery_holds(holder_id()), idle.delivery_tag)
        dead = holder_id()
        client.zadd(keys.cpu_workers, {dead: time.time() - 60})  # registered, its heartbeat lapsed (never set)

        def twice(restore: Any) -> Any:
            return lambda key, entry: (restore(key, entry), restore(key, entry))

        reaped = reap_dead_workers(
            client, keys, "the reaper", twice(channel.qos.restore_held), twice(channel.qos.restore_listed)
        )
        assert reaped == {dead: 2}
        assert sorted(bodies_on(client, keys, QUEUE)) == sorted([messages[0].delivery_tag, idle.delivery_tag])
        assert not client.exists(keys.celery_held(dead), keys.celery_holds(dead))
        assert client.zscore(keys.cpu_workers, dead) is None


def test_a_closing_channel_deletes_the_holds_of_acks_no_take_carried_and_a_reject_goes_back(worker):
    connection, client, keys, queue = worker
    publish(connection, queue, "the last one", "rejected")
    messages: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: messages.append(message)], prefetch_count=2):
        drain_until(connection, lambda: len(messages) == 2)
        messages[0].ack()
        messages[1].reject(requeue=True)  # a child killed mid-task: back behind what is queued
        assert bodies_on(client, keys, QUEUE) == [messages[1].delivery_tag]
        assert held(client, keys) == {messages[0].delivery_tag}  # waiting for a take that will not come now
    messages[0].channel.close()
    assert held(client, keys) == set()
    assert bodies_on(client, keys, QUEUE) == [messages[1].delivery_tag]  # acknowledged: not given back


def test_a_take_that_fails_keeps_its_acks_for_the_next_one(worker):
    """A take whose reply is an error (here its queue's key made another type): its acks are not known to be done,
    so they, and their held list entries, wait for the next take or flush, which deletes them from the list."""
    connection, client, keys, queue = worker
    publish(connection, queue, "done", "next")
    messages: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: messages.append(message)], prefetch_count=1):
        drain_until(connection, lambda: len(messages) == 1)
        channel = messages[0].channel
        messages[0].ack()  # waits for the next take
        client.rename(keys.celery_queue(QUEUE), "saved")
        client.set(keys.celery_queue(QUEUE), "not a list")
        with pytest.raises(redis.ResponseError):
            drain_until(connection, lambda: False, within_s=5)
        assert channel.qos.acks == [messages[0].delivery_tag] and messages[0].delivery_tag in channel.qos.listed
        client.rename("saved", keys.celery_queue(QUEUE))
        drain_until(connection, lambda: len(messages) == 2)
        assert held(client, keys) == {messages[1].delivery_tag}  # the ack rode on the take that brought it


class Rider:
    """A read that rides on each take (tasks.hop.broker.TakeRider): what it sent and what it was given back."""

    def __init__(self, *commands: tuple[Any, ...]) -> None:
        self.commands = list(commands)
        self.given: list[list[Any]] = []

    def ride(self) -> list[tuple[Any, ...]]:
        return list(self.commands)

    def took(self, replies: list[Any]) -> None:
        self.given.append(replies)


def test_a_rider_reads_in_each_take_and_its_error_does_not_fail_the_take(worker):
    """Under load a rider's commands go in each take's pipeline (no round trip of their own) and their replies come
    back to it; a rider's command that fails is handed to it as its error, and the take's messages still arrive."""
    connection, client, keys, queue = worker
    client.hset("depths", mapping={"a": 3, "b": 5})
    client.rpush("not-a-hash", "x")
    publish(connection, queue, *[f"task {n}" for n in range(4)])
    seen: list[str] = []
    rider = Rider(("HMGET", "depths", "a", "b"), ("HMGET", "not-a-hash", "a"))

    def on_message(body: str, message: Any) -> None:
        seen.append(body)
        message.ack()

    client.config_resetstat()
    with connection.Consumer(queue, callbacks=[on_message], prefetch_count=1) as consumer:
        consumer.channel.rider = rider
        drain_until(connection, lambda: len(seen) == 4)
    assert seen == [f"task {n}" for n in range(4)]
    assert len(rider.given) >= 4  # a take a message, at least (and the one that found the queue empty)
    for depths, failed in rider.given:
        assert depths == [b"3", b"5"]
        assert isinstance(failed, redis.ResponseError) and "WRONGTYPE" in str(failed)
    # Every HMGET rode on a take: as many as the takes that carried the rider, none sent alone.
    assert calls(client)["hmget"] == 2 * len(rider.given)


def test_a_busy_workers_full_list_check_reads_the_depths_its_last_take_brought(worker, tmp_path):
    """The CPU worker's pause check (tasks.hop.full_lists) rides on the consumer's takes while its checks come close:
    within the check's period of a take it reads no Redis of its own, and past it (a worker not taking) it reads the
    depths itself."""
    from types import SimpleNamespace

    from contract.settings.config import load_settings
    from tasks.hop.celery_app import make_celery
    from tasks.hop.full_lists import CLOSE_CHECK_S, PauseWhileFrameListFull

    connection, client, keys, queue = worker
    loaded = load_settings()
    url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
    settings = dataclasses.replace(
        loaded, redis_url=url, namespace="take", bulk=dataclasses.replace(loaded.bulk, redis_urls=(url,))
    )
    step = PauseWhileFrameListFull(SimpleNamespace(app=make_celery(settings)))
    step.client = redis.Redis.from_url(url)
    models = [spec.key for spec in settings.models]
    client.hset(keys.frames_waiting, mapping={model: 7 + n for n, model in enumerate(models)})
    assert step.ride() == []  # calm: its checks come seldom and read for themselves
    step.busy_until = time.monotonic() + 60  # a list half full lately: its checks come close
    publish(connection, queue, "task")
    seen: list[str] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: seen.append(body)], prefetch_count=1) as consumer:
        step._ride_the_takes(SimpleNamespace(task_consumer=consumer))
        assert consumer.channel.rider is step
        drain_until(connection, lambda: bool(seen))
    assert step.taken_depths == [7 + n for n in range(len(models))]
    client.config_resetstat()
    step.taken_at = time.monotonic()  # as fresh as a take just sent
    assert step._depths() == [7 + n for n in range(len(models))]
    assert "hmget" not in calls(client)
    client.hset(keys.frames_waiting, models[0], 40)
    step.taken_at = time.monotonic() - 2 * CLOSE_CHECK_S  # the last take is older than a check's period
    assert step._depths()[0] == 40
    assert calls(client)["hmget"] == 1
    step.client.close()


def pause_step(client: redis.Redis, sharded: bool, models: int = 1) -> Any:
    """The CPU worker's pause check (tasks.hop.full_lists) on this test's Redis, its lists' checks coming close."""
    from types import SimpleNamespace

    from contract.settings.config import load_settings
    from tasks.hop.celery_app import make_celery
    from tasks.hop.full_lists import PauseWhileFrameListFull

    loaded = load_settings()
    url = f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
    specs = tuple(dataclasses.replace(loaded.model, version=f"9.{n}") for n in range(models))
    settings = dataclasses.replace(
        loaded,
        redis_url=url,
        namespace="take",
        model=specs[0],
        models=specs,
        bulk=dataclasses.replace(loaded.bulk, redis_urls=(url,) if sharded else ()),
    )
    step = PauseWhileFrameListFull(SimpleNamespace(app=make_celery(settings)))
    step.client = redis.Redis.from_url(url)
    step.busy_until = time.monotonic() + 60
    return step


def test_without_shards_the_check_reads_each_models_list_length_in_the_take_in_order(worker):
    """No bulk shards: the ride is one LLEN a model, and its replies (after the acks' and the moves') map to the
    models in order, however many acks and moves the take carried."""
    from types import SimpleNamespace

    connection, client, keys, queue = worker
    step = pause_step(client, sharded=False, models=3)
    for index, frames in enumerate(step.frames):
        client.rpush(frames, *[b"f"] * (2 + 3 * index))
    publish(connection, queue, *[f"task {n}" for n in range(5)])
    seen: list[str] = []

    def on_message(body: str, message: Any) -> None:
        seen.append(body)
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message], prefetch_count=2) as consumer:
        step._ride_the_takes(SimpleNamespace(task_consumer=consumer))
        drain_until(connection, lambda: len(seen) == 5)
        drain_until(connection, lambda: held(client, keys) == set())  # the last acks, carried by the empty take
    assert seen == [f"task {n}" for n in range(5)]
    assert step.taken_depths == [2, 5, 8]
    step.client.close()


def test_an_odd_reading_in_the_take_costs_the_take_nothing(worker):
    """The check's reading of the shards' counts, kept on the control plane, is not a number (a hand's HSET, a
    tool's mistake): the check does not use it, and the take's message is delivered all the same. Its own read
    met the same value in a timer before (logged there); in the take it must not strand what the take moved."""
    from types import SimpleNamespace

    connection, client, keys, queue = worker
    step = pause_step(client, sharded=True)
    client.hset(keys.frames_waiting, step.settings.models[0].key, "not a count")
    publish(connection, queue, "task")
    seen: list[str] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: seen.append(body)], prefetch_count=1) as consumer:
        step._ride_the_takes(SimpleNamespace(task_consumer=consumer))
        drain_until(connection, lambda: bool(seen))
    assert seen == ["task"] and step.taken_depths is None
    step.client.close()


class FailingRider(Rider):
    """A rider whose own code raises: in its second `ride` (a take that carries an ack) and its second `took`."""

    def __init__(self, *commands: tuple[Any, ...]) -> None:
        super().__init__(*commands)
        self.rides = self.tooks = 0
        self.raised: list[str] = []

    def ride(self) -> list[tuple[Any, ...]]:
        self.rides += 1
        if self.rides == 2:
            self.raised.append("ride")
            raise RuntimeError("ride")
        return super().ride()

    def took(self, replies: list[Any]) -> None:
        self.tooks += 1
        if self.tooks == 2:
            self.raised.append("took")
            raise RuntimeError("took")
        super().took(replies)


def test_a_rider_that_raises_loses_no_ack_and_no_message(worker):
    """A rider is another step's read: its exception in `ride` (the take's acks already taken in hand) or in `took`
    (the take's messages already moved into the held list) must not cost the take its acks or its messages, nor
    reach the consumer's loop (an error there stops a Celery worker)."""
    connection, client, keys, queue = worker
    publish(connection, queue, *[f"task {n}" for n in range(4)])
    seen: list[str] = []
    rider = FailingRider(("LLEN", "anything"))

    def on_message(body: str, message: Any) -> None:
        seen.append(body)
        message.ack()

    with connection.Consumer(queue, callbacks=[on_message], prefetch_count=1) as consumer:
        consumer.channel.rider = rider
        drain_until(connection, lambda: len(seen) == 4)
        drain_until(connection, lambda: calls(client).get("brpop", 0) >= 1)  # the empty take carried the last ack
    assert seen == [f"task {n}" for n in range(4)] and rider.raised == ["ride", "took"]
    assert held(client, keys) == set()  # every ack carried: nothing to give back and run twice
    assert rider.given and all(replies == [0] for replies in rider.given)


def test_a_take_whose_move_fails_still_hands_the_rider_its_reading_and_keeps_its_acks(worker):
    connection, client, keys, queue = worker
    publish(connection, queue, "done", "next")
    messages: list[Any] = []
    rider = Rider(("LLEN", "some-list"))
    client.rpush("some-list", "a", "b")
    with connection.Consumer(queue, callbacks=[lambda body, message: messages.append(message)], prefetch_count=1):
        drain_until(connection, lambda: len(messages) == 1)
        channel = messages[0].channel
        channel.rider = rider
        messages[0].ack()
        client.rename(keys.celery_queue(QUEUE), "saved")
        client.set(keys.celery_queue(QUEUE), "not a list")
        with pytest.raises(redis.ResponseError):
            drain_until(connection, lambda: False, within_s=5)
        assert rider.given == [[2]]  # the move's error is the take's, not the rider's
        assert channel.qos.acks == [messages[0].delivery_tag]
        client.rename("saved", keys.celery_queue(QUEUE))
        drain_until(connection, lambda: len(messages) == 2)
        assert held(client, keys) == {messages[1].delivery_tag}


def test_a_connection_lost_in_the_riders_replies_keeps_what_the_take_moved(worker):
    """The connection drops after the take's moves were read, in the rider's replies (here a rider's command that has
    Redis close it): the messages the moves brought are held already, so the channel keeps them to deliver (or give
    back at a close), not leaving them held by no task until restore_unheld's grace."""
    connection, client, keys, queue = worker
    publish(connection, queue, *[f"task {n}" for n in range(3)])
    seen: list[str] = []
    lost: list[Exception] = []
    rider = Rider(("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "no"), ("LLEN", "anything"))
    once = rider.ride
    rider.ride = lambda: [once(), setattr(rider, "commands", [])][0]  # type: ignore[method-assign]

    def on_message(body: str, message: Any) -> None:
        seen.append(body)
        message.ack()
        if len(seen) == 1:  # the second take's connection drops, once
            consumer.channel.rider = rider

    deadline = time.monotonic() + 10
    with connection.Consumer(queue, callbacks=[on_message], prefetch_count=1) as consumer:
        while len(seen) < 3 or held(client, keys):
            assert time.monotonic() < deadline, (seen, lost)
            try:
                connection.drain_events(timeout=0.2)
            except TimeoutError:
                pass
            except redis.ConnectionError as error:
                lost.append(error)
    assert seen == [f"task {n}" for n in range(3)] and len(lost) == 1
