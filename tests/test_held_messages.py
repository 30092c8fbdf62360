"""What gives a Celery message back once tasks.hop.broker no longer keeps kombu's ack emulation (issue 58): each way a
held message can be stranded, on a real Redis with the product's transport. The whole-stack versions (a worker
killed with a task in hand, killed as it takes one, a failover that lost an ack) are in test_make_run.py and
test_failover.py."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import kombu
import pytest
import redis

from contract.redis.keys import CELERY_HOLDS, Keys
from tasks.hop.broker import TRANSPORT, holder_id
from tasks.hop.given_back import reap_dead_workers

QUEUE = "held-q"


@pytest.fixture
def channel(redis_server, request) -> Iterator[tuple[Any, redis.Redis, Keys]]:
    keys = Keys(f"held-{request.node.name[-24:]}")
    client = redis.Redis.from_url(redis_server.url)
    with kombu.Connection(
        redis_server.url,
        transport=TRANSPORT,
        transport_options={"global_keyprefix": keys.celery_prefix, "visibility_timeout": 60},
    ) as connection:
        yield connection.channel(), client, keys


def publish_and_take(channel: Any, *bodies: str) -> list[Any]:
    queue = kombu.Queue(QUEUE, kombu.Exchange(QUEUE, type="direct"), QUEUE)
    for body in bodies:
        kombu.Producer(channel).publish(body, exchange=queue.exchange, routing_key=QUEUE, declare=[queue])
    return [queue(channel).get(no_ack=False) for _ in bodies]


def on_queue(client: redis.Redis, keys: Keys) -> list[str]:
    """The bodies on the queue, the one BRPOP takes next first."""
    raws = reversed(client.lrange(keys.celery_queue(QUEUE), 0, -1))
    return [base64.b64decode(json.loads(raw)["body"]).decode() for raw in raws]


def test_a_rejected_message_goes_back_to_its_queue_and_out_of_the_holds(channel):
    """A child killed mid-task: Celery rejects its message with requeue (task_reject_on_worker_lost); kombu puts it
    behind what is queued (its `leftmost`), and so does this transport."""
    channel, client, keys = channel
    first, second = publish_and_take(channel, "killed child's", "other")
    kombu.Producer(channel).publish("queued", exchange=QUEUE, routing_key=QUEUE)
    first.reject(requeue=True)
    assert on_queue(client, keys) == ["queued", "killed child's"]
    assert client.hkeys(keys.celery_holds(holder_id())) == [second.delivery_tag.encode()]
    second.reject(requeue=False)  # a task that failed for good: gone, not back
    assert client.hlen(keys.celery_holds(holder_id())) == 0 and on_queue(client, keys) == ["queued", "killed child's"]


def test_a_clean_stop_gives_back_what_the_worker_holds(channel):
    channel, client, keys = channel
    publish_and_take(channel, "a", "b")
    channel.qos.restore_unacked_once()
    assert sorted(on_queue(client, keys)) == ["a", "b"]
    assert client.hlen(keys.celery_holds(holder_id())) == 0


def test_a_dead_workers_messages_go_back_at_once_and_twice_restored_are_back_once(channel):
    """The reaper reads the dead worker's holds (another process's hash) and restores through this one's channel."""
    channel, client, keys = channel
    publish_and_take(channel, "dead's first", "dead's second")
    dead = holder_id()
    # Seen from another worker: the dead one registered, its heartbeat lapsed (never set here).
    client.zadd(keys.cpu_workers, {dead: time.time() - 60})
    restored: list[tuple[str, str]] = []

    def restore(holds_key: str, tag: str) -> None:
        restored.append((holds_key, tag))
        channel.qos.restore_held(holds_key, tag)
        channel.qos.restore_held(holds_key, tag)  # a reaper cut short and run again

    assert reap_dead_workers(client, keys, "the reaper", restore, channel.qos.restore_listed) == {dead: 2}
    assert {holds_key for holds_key, _ in restored} == {CELERY_HOLDS + dead}
    assert sorted(on_queue(client, keys)) == ["dead's first", "dead's second"]
    assert not client.exists(keys.celery_holds(dead)) and not client.zscore(keys.cpu_workers, dead)


def test_a_message_a_worker_of_the_release_before_held_comes_back_after_the_visibility_timeout(channel):
    """Kombu's unacked hash and index, as the release before this one wrote them: kombu's own restore still reads
    them, so an old worker killed during an upgrade strands nothing for good."""
    channel, client, keys = channel
    (taken,) = publish_and_take(channel, "the old worker's")
    held = client.hget(keys.celery_holds(holder_id()), taken.delivery_tag)
    message, exchange, routing_key, _ = json.loads(held)
    client.hdel(keys.celery_holds(holder_id()), taken.delivery_tag)  # as if the old worker had taken it
    client.hset(keys.celery_prefix + "unacked", "old-tag", json.dumps([message, exchange, routing_key]))
    client.zadd(keys.celery_prefix + "unacked_index", {"old-tag": time.time() - 30})
    channel.qos.restore_visible(num=10, interval=1)
    assert on_queue(client, keys) == []  # 30 s old: within the visibility timeout (60 s here)
    client.zadd(keys.celery_prefix + "unacked_index", {"old-tag": time.time() - 61})
    channel.qos.restore_visible(num=10, interval=1)
    assert on_queue(client, keys) == ["the old worker's"]
    assert not client.hlen(keys.celery_prefix + "unacked") and not client.zcard(keys.celery_prefix + "unacked_index")


def test_a_connection_switched_to_the_next_broker_url_keeps_this_transport():
    """A failover: kombu's Connection.switch takes the next URL's scheme as the transport. It must stay this one
    (its holds), not become kombu's own; the worker's liveness needs HeldQoS (it crashed on kombu's)."""
    from tasks.hop.broker import Channel, own_the_schemes

    own_the_schemes()
    for url in ("redis://127.0.0.1:1/0", "sentinel://127.0.0.1:1/0"):
        connection = kombu.Connection("redis://127.0.0.1:2/0", transport=TRANSPORT)
        connection.switch(url)
        assert issubclass(connection.transport.Channel, Channel), url
