"""The CPU hop's take (tasks.broker's Channel and the library's take_and_hold) as a consuming worker meets it, on a
real Redis with the product's transport and kombu's own poller (the loop a Celery worker's consumer runs): under
load each poll is one step that takes, holds and carries the acks since the last one; a take that finds nothing
turns the worker to BRPOP, and what BRPOP brings turns it back."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import kombu
import pytest
import redis

from bench.processes import RedisServer
from contract.keys import Keys
from contract.library import ensure_library
from tasks.broker import TRANSPORT, holder_id
from tasks.given_back import restore_unheld

QUEUE = "take-q"


@pytest.fixture
def worker(tmp_path) -> Iterator[tuple[Any, redis.Redis, Keys, kombu.Queue]]:
    """A kombu connection on a redis-server of this test's alone (INFO's counts are the whole server's)."""
    server = RedisServer(tmp_path)
    client = redis.Redis(port=server.port)
    ensure_library(client)
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


def test_under_load_each_take_holds_what_it_brings_and_carries_the_acks_since_the_last(worker):
    connection, client, keys, queue = worker
    publish(connection, queue, *[f"task {n}" for n in range(6)])
    holds = keys.celery_holds(holder_id())
    seen: list[str] = []
    held_when_seen: list[bool] = []

    def on_message(body: str, message: Any) -> None:
        seen.append(body)
        held_when_seen.append(bool(client.hexists(holds, message.delivery_tag)))
        message.ack()  # a task that ended: its hold goes with the next take, not with an HDEL of its own

    client.config_resetstat()
    with connection.Consumer(queue, callbacks=[on_message], prefetch_count=2):
        drain_until(connection, lambda: len(seen) == 6)
        assert seen == [f"task {n}" for n in range(6)]
        assert all(held_when_seen)  # held before its task began: no window between the pop and the hold
        counted = calls(client)
        # Six messages in takes of up to two (the prefetch credit): each took, held and acknowledged in FCALLs
        # alone; no BRPOP while messages were queued.
        assert counted.get("brpop", 0) == 0, counted
        assert counted["rpop"] >= 6 and counted["hset"] == 6, counted
        assert counted["fcall"] <= 4, counted
        # The queue found empty: the take that found it so carried the last acks, and the worker waits in BRPOP.
        drain_until(connection, lambda: calls(client).get("brpop", 0) >= 1)
        assert client.hlen(holds) == 0
        publish(connection, queue, "after the lull")
        drain_until(connection, lambda: len(seen) == 7)
        drain_until(connection, lambda: client.hlen(holds) == 0)  # idle again: the ack deleted at once


def test_a_held_message_that_no_task_holds_goes_back_and_an_acknowledged_one_does_not(worker):
    """restore_unheld (a failover lost an ack or a delivery) reads the holds the take wrote; an ack not yet carried
    by a take is flushed first, so its message is not taken for lost and sent again."""
    connection, client, keys, queue = worker
    publish(connection, queue, "done", "lost")
    holds = keys.celery_holds(holder_id())
    messages: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: messages.append(message)], prefetch_count=2):
        drain_until(connection, lambda: len(messages) == 2)
        channel = messages[0].channel
        messages[0].ack()
        held = {tag.decode(): json.loads(value) for tag, value in client.hgetall(holds).items()}
        assert set(held) == {message.delivery_tag for message in messages}  # the ack not yet carried
        assert [entry[1:3] for entry in held.values()] == [["take-q", "take-q"]] * 2  # exchange, routing key
        later = max(entry[3] for entry in held.values()) + 60
        restored = restore_unheld(client, keys, holder_id(), channel, set(), later)
        assert restored == 1
        assert client.hlen(holds) == 0
        back = [json.loads(raw) for raw in client.lrange(keys.celery_queue(QUEUE), 0, -1)]
        assert [entry["properties"]["delivery_tag"] for entry in back] == [messages[1].delivery_tag]


def test_a_redis_that_lost_the_library_gets_it_back_and_the_take_goes_on(worker):
    connection, client, keys, queue = worker
    client.function_flush()
    publish(connection, queue, "after a restart without its data")
    seen: list[str] = []
    holds = keys.celery_holds(holder_id())
    with connection.Consumer(queue, callbacks=[lambda body, message: (seen.append(body), message.ack())]):
        drain_until(connection, lambda: seen == ["after a restart without its data"])
        drain_until(connection, lambda: client.hlen(holds) == 0)  # the ack, on the take after it
    assert client.fcall_ro("imgserve_version", 0)


def test_a_closing_channel_deletes_the_holds_of_acks_no_take_carried(worker):
    connection, client, keys, queue = worker
    publish(connection, queue, "the last one")
    messages: list[Any] = []
    with connection.Consumer(queue, callbacks=[lambda body, message: messages.append(message)], prefetch_count=1):
        drain_until(connection, lambda: len(messages) == 1)
        messages[0].ack()
        assert client.hlen(keys.celery_holds(holder_id())) == 1  # waiting for a take that will not come now
    messages[0].channel.close()
    assert client.hlen(keys.celery_holds(holder_id())) == 0
    assert client.llen(keys.celery_queue(QUEUE)) == 0  # acknowledged: not given back as unacked


@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")], ids=["as-kombu-writes", "compact"])
def test_the_take_records_the_tag_exchange_and_routing_key_however_the_json_is_spaced(worker, separators):
    """The take reads a message's delivery fields as text (kombu's spacing) and decodes one written otherwise: either
    way its hold is what restore_held reads back, and the message goes back to its own queue."""
    connection, client, keys, queue = worker
    channel = connection.channel()
    queue(channel).declare()
    message = {
        "body": "IltdIg==",
        "content-type": "application/json",
        "headers": {"note": 'a "delivery_tag": "not-this" in a header'},
        "properties": {"delivery_info": {"exchange": QUEUE, "routing_key": QUEUE}, "delivery_tag": "the-tag"},
    }
    client.lpush(keys.celery_queue(QUEUE), json.dumps(message, separators=separators))
    taken = queue(channel).get(no_ack=False)
    assert taken.delivery_tag == "the-tag"
    held = json.loads(client.hget(keys.celery_holds(holder_id()), "the-tag"))
    assert held[:3] == [message, QUEUE, QUEUE]
    taken.reject(requeue=True)
    assert client.hlen(keys.celery_holds(holder_id())) == 0
    assert json.loads(client.lindex(keys.celery_queue(QUEUE), 0))["properties"]["delivery_tag"] == "the-tag"
