"""A preprocess task that a worker took from Redis and died with before kombu recorded it (tasks.hop.lost_deliveries):
found by looking where a message can be, and sent again, once."""

from __future__ import annotations

import json
import time

import kombu
import redis

from contract.jobs.task_messages import PreprocessMessages
from contract.redis.keys import Keys
from tasks.hop.broker import TRANSPORT, holder_id
from tasks.hop.lost_deliveries import MAX_RESENDS, LostDeliveries, jobs_named

QUEUE = "preprocess:m:1"


def queued_job(client: redis.Redis, keys: Keys, job_id: str, submitted_at: float, **fields: str) -> None:
    client.hset(
        keys.job(job_id),
        mapping={"id": job_id, "status": "queued", "submitted_at": repr(submitted_at), "queue": QUEUE, **fields},
    )
    client.zadd(keys.deadlines, {job_id: submitted_at + 60})


def one_stale_job(redis_server, namespace: str, job_id: str) -> tuple[Keys, redis.Redis, float]:
    """A private namespace with one job `queued` 30 s ago (past lost_delivery_s), its task nowhere yet."""
    keys = Keys(namespace)
    client = redis.Redis.from_url(redis_server.url)
    now = time.time()
    queued_job(client, keys, job_id, now - 30)
    return keys, client, now


def test_a_job_whose_task_is_nowhere_twice_is_sent_it_again_and_no_other_is(redis_server):
    keys = Keys("lost")
    client = redis.Redis.from_url(redis_server.url)
    queue_key = keys.celery_queue(QUEUE)
    messages = PreprocessMessages()
    now = time.time()
    on_queue, in_hand, lost, young, claimed, unnamed, listed = (c * 32 for c in "abcdef0")
    for job_id in (on_queue, in_hand, lost, listed):
        queued_job(client, keys, job_id, now - 30)
    queued_job(client, keys, young, now - 1)  # within lost_delivery_s: its message may be on its way
    queued_job(client, keys, claimed, now - 30, status="preprocessing")  # a worker has it
    queued_job(client, keys, unnamed, now - 30)
    client.hdel(keys.job(unnamed), "queue")  # a record from before records named their queue: left alone
    with kombu.Connection(
        redis_server.url, transport=TRANSPORT, transport_options={"global_keyprefix": keys.celery_prefix}
    ) as connection:
        channel = connection.channel()
        client.lpush(queue_key, messages.build(in_hand, QUEUE))
        taken = kombu.Queue(QUEUE, kombu.Exchange(QUEUE, type="direct"), QUEUE)(channel).get(no_ack=False)
        assert taken is not None and taken.headers["argsrepr"] == repr([in_hand])  # in this process's holds now
        client.zadd(keys.cpu_workers, {holder_id(): now})  # a worker registers before it takes a task
        client.lpush(queue_key, messages.build(on_queue, QUEUE))
        # Moved by a take into the worker's held list (LMOVE: the message as it lay on its queue): in hand too.
        client.lpush(keys.celery_held(holder_id()), messages.build(listed, QUEUE))
        lost_deliveries = LostDeliveries(client, keys, keys.celery_prefix + channel.unacked_key, after_s=5.0)

        assert lost_deliveries.check(now) == []  # seen nowhere once: a suspect
        assert [m.decode() for m in client.zrange(keys.lost_deliveries_suspects, 0, -1)] == [lost]
        assert lost_deliveries.check(now + 1) == []  # another round under way (the lock)
        client.delete(keys.lost_deliveries_lock)  # the next round
        assert lost_deliveries.check(now + 5) == [lost]
        assert client.hget(keys.job(lost), "resent") == b"1"
        assert jobs_named(client.lrange(queue_key, -1, -1)) == {lost}  # at the front: BRPOP takes it next
        client.hset(keys.job(young), "status", "preprocessing")  # (taken meanwhile: not this test's)
        client.delete(keys.lost_deliveries_lock)
        assert lost_deliveries.check(now + 10) == []  # on its queue now: not sent twice

        again = kombu.Queue(QUEUE, kombu.Exchange(QUEUE, type="direct"), QUEUE)(channel).get(no_ack=False)
        assert again is not None and json.loads(again.body) == [[lost], {}, again.payload[2]]
        assert again.headers["task"] == "imgserve.preprocess"
        for message in (taken, again):
            message.ack()


def test_a_job_that_ends_between_two_looks_is_not_sent_again(redis_server):
    job_id = "9" * 32
    keys, client, now = one_stale_job(redis_server, "lost-ended", job_id)
    lost_deliveries = LostDeliveries(client, keys, keys.celery_prefix + "unacked", after_s=5.0)
    assert lost_deliveries.check(now) == []
    client.hset(keys.job(job_id), "status", "cancelled")
    client.delete(keys.lost_deliveries_lock)
    assert lost_deliveries.check(now + 5) == []
    assert client.llen(keys.celery_queue(QUEUE)) == 0


def test_a_task_that_vanishes_every_time_is_sent_again_three_times_then_left_to_its_deadline(redis_server):
    job_id = "8" * 32
    keys, client, now = one_stale_job(redis_server, "lost-again", job_id)
    lost_deliveries = LostDeliveries(client, keys, keys.celery_prefix + "unacked", after_s=5.0)
    sent = []
    for round_ in range(10):
        client.delete(keys.lost_deliveries_lock)
        sent += lost_deliveries.check(now + round_)
        client.delete(keys.celery_queue(QUEUE))  # taken and lost again
    assert sent == [job_id] * MAX_RESENDS
    assert client.hget(keys.job(job_id), "resent") == str(MAX_RESENDS).encode()


def test_a_round_that_outlives_its_lock_does_not_send_a_second_copy_beside_the_next_round(redis_server):
    """The lock lapses after 0.8 of the period: a round slowed past it (a slow Redis, a busy event loop) runs
    beside the next one. Both found the job's task nowhere twice; only one sends it again."""
    job_id = "7" * 32
    keys, client, now = one_stale_job(redis_server, "lost-overlap", job_id)
    slow = LostDeliveries(client, keys, keys.celery_prefix + "unacked", after_s=5.0)
    fast = LostDeliveries(client, keys, keys.celery_prefix + "unacked", after_s=5.0)
    assert slow.check(now) == []  # a suspect
    client.delete(keys.lost_deliveries_lock)
    looked = slow._missing

    def the_next_round_meanwhile(stale):  # the slow round has looked; its lock lapses and the next round runs
        missing = looked(stale)
        client.delete(keys.lost_deliveries_lock)
        assert fast.check(now + 5) == [job_id]
        return missing

    slow._missing = the_next_round_meanwhile  # type: ignore[method-assign]
    assert slow.check(now + 5) == []
    assert client.llen(keys.celery_queue(QUEUE)) == 1
    assert client.hget(keys.job(job_id), "resent") == b"1"


def test_a_held_list_an_older_reaper_left_behind_has_its_jobs_sent_again(redis_server):
    """A rolling upgrade: a newer worker found dead by an older one's reaper, which gives back its hash, deletes it
    from the registry and leaves its held list (docs/upgrading.md). A held list of no registered worker is no
    worker's hands: its job, still `queued`, is sent its task again after two rounds. A registered worker's is not."""
    job_id, kept = "6" * 32, "5" * 32
    keys, client, now = one_stale_job(redis_server, "lost-left", job_id)
    queued_job(client, keys, kept, now - 30)
    messages = PreprocessMessages()
    client.lpush(keys.celery_held("newer-worker-found-dead"), messages.build(job_id, QUEUE))
    client.zadd(keys.cpu_workers, {"a-live-worker": now})
    client.lpush(keys.celery_held("a-live-worker"), messages.build(kept, QUEUE))
    lost_deliveries = LostDeliveries(client, keys, keys.celery_prefix + "unacked", after_s=5.0)
    assert lost_deliveries.check(now) == []
    client.delete(keys.lost_deliveries_lock)
    assert lost_deliveries.check(now + 5) == [job_id]
    assert jobs_named(client.lrange(keys.celery_queue(QUEUE), 0, -1)) == {job_id}
