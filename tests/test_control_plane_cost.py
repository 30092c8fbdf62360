"""What each step of a job costs the control plane's Redis, counted by Redis itself (issue 58): a guard that a change
to a step does not quietly add commands to every image. `bench plane` measures the same steps' µs under load."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from bench.stack.processes import RedisServer, wait_until
from contract.frames import frame_push as frames
from contract.frames.frame_shards import frame_pusher
from contract.jobs.handoff import JobHandOff
from contract.jobs.intake import JobIntake
from contract.jobs.record import PREPROCESSING, RUNNING, SUCCEEDED
from contract.library import ensure_library
from contract.redis.keys import Keys
from contract.redis.shards import BulkPlane


@pytest.fixture
def quiet_redis(tmp_path) -> Iterator[redis.Redis]:
    """A redis-server of this test's alone: INFO's counts are the whole server's, and the suite's shared one may be
    spoken to by a thread an earlier test in this process left (its counts then read 10 where the step sent 7)."""
    server = RedisServer(tmp_path)
    client = redis.Redis(port=server.port)
    yield client
    client.close()
    server.stop()


# What a new connection sends before its first command, and the library's check (contract.library): once a
# connection or a process, not once an image.
_CONNECTING = {
    "cmdstat_hello",
    "cmdstat_select",
    "cmdstat_client|setinfo",
    "cmdstat_client|setname",
    "cmdstat_fcall_ro",
    "cmdstat_function|list",
    "cmdstat_function|load",
}


def commands_of(client: redis.Redis, step: Callable[[], Any]) -> dict[str, int]:
    """The commands Redis ran for `step` (a script's own calls counted, as INFO counts them), by name, less what
    opening a connection sends."""
    client.config_resetstat()
    step()
    return counted(client)


def counted(client: redis.Redis) -> dict[str, int]:
    """The commands Redis ran since its stats were reset, as commands_of counts them."""
    stats: dict[str, Any] = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name not in ("cmdstat_config|resetstat", "cmdstat_info", *_CONNECTING)
    }


def test_each_step_of_a_job_costs_the_control_plane_a_bounded_number_of_commands(quiet_redis):
    keys = Keys("cost")
    intake = JobIntake(quiet_redis, keys, ttl_s=60)
    handoff = JobHandOff(quiet_redis, keys, ttl_s=60)
    pusher = frame_pusher(quiet_redis, keys)
    job = "c0" * 16
    quiet_redis.hset(keys.waiting_bytes, mapping={"m:1": 6})  # the upload's bytes, as admission counted
    ensure_library(quiet_redis)  # loaded, as a worker has it

    create = commands_of(
        quiet_redis,
        lambda: intake.create(job, b"upload", 60, {"model": "m:1", "bytes": 6, "deadline_at": 1e12}, ("q", b"m")),
    )
    # the upload, then MULTI HSET EXPIRE ZADD LPUSH EXEC
    assert sum(create.values()) == 7, create

    claim = commands_of(quiet_redis, lambda: handoff.claim_for_preprocessing(job, 100.0, "mine"))
    # GET (the upload), FCALL (HMGET, HSET), HMGET of the fields the worker reads: was GET, FCALL (HGET, HGET,
    # HSET, HGETALL), then GET, FCALL (HMGET, HSET), HGETALL of the whole record
    assert sum(claim.values()) == 5 and claim["hmget"] == 2 and "hgetall" not in claim and "hget" not in claim, claim

    push = commands_of(quiet_redis, lambda: pusher.push(job, "m:1", b"frame!!!", 10, {"pushed_at": 1.0}, "mine"))
    # MULTI LPUSH FCALL (HMGET LLEN DEL HSET HINCRBY) EXEC: was 17 (EVAL, a read and a counter move a field),
    # then 11 (an EXISTS of the upload before its DEL), then 10 (a HINCRBY for the total beside the model's)
    assert sum(push.values()) == 9 and push["hincrby"] == 1 and "exists" not in push, push

    running = commands_of(quiet_redis, lambda: intake.advance_many([job], RUNNING, 3))
    assert sum(running.values()) == 3, running  # FCALL (HMGET, HSET)

    ended = commands_of(quiet_redis, lambda: intake.finish(job, SUCCEEDED, {"result": {"detections": []}}))
    # FCALL (HMGET, HSET, ZREM, PUBLISH): the record read once, no callback, no cache key, no DEL of an upload the
    # push took, and no EXPIRE (the record made with a deadline lives until jobs.ttl_s past it)
    assert sum(ended.values()) == 5 and ended["hmget"] == 1 and "hget" not in ended, ended
    assert "del" not in ended and "expire" not in ended, ended
    assert intake.load(job)["status"] == SUCCEEDED


def test_the_push_trades_the_uploads_bytes_for_the_frames_as_a_release_then_a_charge_would(quiet_redis):
    """One HINCRBY a counter for the difference, with the result the two steps gave: the release stops at zero (a
    count that drifted below the upload's bytes), the frame's bytes are charged in full."""
    keys = Keys("trade")
    intake = JobIntake(quiet_redis, keys, ttl_s=60)
    handoff = JobHandOff(quiet_redis, keys, ttl_s=60)
    pusher = frame_pusher(quiet_redis, keys)
    for job, counted in (("a" * 32, 1000), ("b" * 32, 30)):  # counted: the waiting bytes before the push
        quiet_redis.delete(keys.waiting_bytes)
        quiet_redis.hset(keys.waiting_bytes, mapping={"m:1": counted})
        intake.create(job, b"u" * 100, 60, {"model": "m:1", "bytes": 100, "deadline_at": 1e12})
        assert handoff.claim_for_preprocessing(job, 1.0, "c")[0] == "claimed"
        assert pusher.push(job, "m:1", b"f" * 40, 10, {}, "c") == frames.PUSHED
        waiting = {k.decode(): int(v) for k, v in quiet_redis.hgetall(keys.waiting_bytes).items()}
        assert waiting == {"m:1": max(0, counted - 100) + 40}, (job, waiting)  # one counter: the total is a sum


def test_a_push_to_a_redis_that_forgot_its_step_takes_its_frame_back_and_pushes_once(quiet_redis):
    """The push calls the library's function by name: on a Redis that came back without the library, the
    transaction's LPUSH lands and its FCALL answers "Function not found"; the frame must not stay there unkept, and
    the push must still be made."""
    keys = Keys("noscript")
    intake = JobIntake(quiet_redis, keys, ttl_s=60)
    handoff = JobHandOff(quiet_redis, keys, ttl_s=60)
    pusher = frame_pusher(quiet_redis, keys)
    job = "d1" * 16
    intake.create(job, b"upload", 60, {"model": "m:1", "bytes": 6, "deadline_at": 1e12})
    assert handoff.claim_for_preprocessing(job, 1.0, "c")[0] == "claimed"
    assert pusher.push("e0" * 16, "m:1", b"another job's", 10, {}, "c") == frames.JOB_OVER  # (loads the step)
    quiet_redis.function_flush()  # as a Redis that came back empty, on a connection that stayed up
    assert pusher.push(job, "m:1", b"the frame", 10, {"pushed_at": 2.0}, "c") == frames.PUSHED
    assert quiet_redis.lrange(keys.frames("m:1"), 0, -1) == [b"the frame"]  # once, kept
    assert intake.load(job)["status"] == "queued_gpu"
    pushed = commands_of(quiet_redis, lambda: pusher.push(job, "m:1", b"again", 10, {}, "c"))
    assert "eval" not in pushed and pushed["fcall"] == 1, pushed  # the step's text is not sent at every push


def test_a_claim_over_bulk_shards_costs_the_control_plane_one_round_trip_and_no_script_lookup(quiet_redis):
    """With shards the claim's step and the record's read go to the control plane as one pipeline: redis-py's Script
    in a pipeline asked SCRIPT EXISTS before each (a round trip more an image: it did, for a moment)."""
    control = quiet_redis
    shard = redis.Redis(port=quiet_redis.connection_pool.connection_kwargs["port"], db=3)
    keys = Keys("sharded")
    bulk = BulkPlane(control, [shard])
    intake = JobIntake(control, keys, ttl_s=60, bulk=bulk)
    handoff = JobHandOff(control, keys, ttl_s=60, bulk=bulk)
    job = "e2" * 16
    intake.create(job, b"upload", 60, {"model": "m:1", "bytes": 6, "deadline_at": 1e12})
    ensure_library(control)
    claim = commands_of(control, lambda: handoff.claim_for_preprocessing(job, 1.0, "c"))
    # the control plane: FCALL (HMGET, HSET), HMGET; the upload's GET went to the shard (the same server here)
    assert "script|exists" not in claim and claim["fcall"] == 1 and claim["hmget"] == 2, claim
    assert "hgetall" not in claim, claim
    control.function_flush()  # a control plane that came back empty: the library loaded again, the claim made
    verdict, upload, record, _ = handoff.claim_for_preprocessing(job, 2.0, "d")
    assert (verdict, upload, record["status"], record["model"]) == ("claimed", b"upload", PREPROCESSING, "m:1")
    assert intake.load(job)["claim"] == "d"


HOP_COMMANDS = {"lmove", "lrem", "rpop", "brpop", "hset", "hdel", "fcall", "zadd"}  # the take, hold and ack


def test_celery_takes_and_holds_a_task_in_one_step_and_lets_it_go_with_one(quiet_redis):
    """The product's transport (tasks.hop.broker) takes a message and holds it in one step (a consuming worker's take:
    LMOVE into its held list), and the ack deletes it (LREM, riding on the next take's pipeline): kombu's ack
    emulation spent MULTI ZADD HSET EXEC and MULTI ZREM HDEL EXEC (with the worker's own set, 10 commands a task).
    basic_get (no consumer) is kombu's RPOP, then the hash's HSET, and its ack an HDEL at once."""
    import time

    import kombu

    from tasks.hop.broker import TRANSPORT, holder_id

    keys = Keys("celery-cost")
    port = quiet_redis.connection_pool.connection_kwargs["port"]
    with kombu.Connection(
        f"redis://127.0.0.1:{port}/0", transport=TRANSPORT, transport_options={"global_keyprefix": keys.celery_prefix}
    ) as connection:
        channel = connection.channel()
        queue = kombu.Queue("cost-q", kombu.Exchange("cost-q", type="direct"), "cost-q")
        kombu.Producer(channel).publish("a task", exchange=queue.exchange, routing_key="cost-q", declare=[queue])
        taken: list[Any] = []
        held = commands_of(quiet_redis, lambda: taken.append(queue(channel).get(no_ack=False)))
        assert held == {"rpop": 1, "hset": 1}, held
        assert taken[0].payload == "a task"
        acked = commands_of(quiet_redis, taken[0].ack)
        assert acked == {"hdel": 1}, acked
        assert quiet_redis.hlen(keys.celery_holds(holder_id())) == 0

        kombu.Producer(channel).publish("a task", exchange=queue.exchange, routing_key="cost-q")
        consumed: list[Any] = []
        quiet_redis.config_resetstat()
        with connection.Consumer(queue, callbacks=[lambda body, message: consumed.append(message)], prefetch_count=1):
            deadline = time.monotonic() + 10
            while not consumed:
                assert time.monotonic() < deadline
                connection.drain_events(timeout=1)
            took = {name: n for name, n in counted(quiet_redis).items() if name in HOP_COMMANDS}  # not the set-up's
            assert took == {"lmove": 1}, took  # one command: the pop and the hold are the same step
            assert quiet_redis.llen(keys.celery_held(holder_id())) == 1
            consumed[0].ack()  # a take is coming: the ack waits for it
            while quiet_redis.llen(keys.celery_held(holder_id())):
                assert time.monotonic() < deadline
                try:
                    connection.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
            after = {name: n for name, n in counted(quiet_redis).items() if name in HOP_COMMANDS}
            assert after["lrem"] == 1 and after["lmove"] == 2, after  # the ack rode on the take that found none
            assert not {"hset", "hdel", "fcall"} & set(after), after


def test_a_batch_of_ends_wakes_long_polls_and_callback_relays_with_one_message_each(quiet_redis):
    """Eight jobs ended in one step: one PUBLISH of their ids on the job-events channel (a long-poll's listener wakes
    each), one RPUSH of the four with a callback and one PUBLISH on the outbox's channel; the callback's state is
    written with the end, not by a second HSET; the uploads' bytes are given back with one HINCRBY a model (the total
    is their sum, read at admission). Was a PUBLISH and two HINCRBY a job, and for a callback an HSET, RPUSH and
    PUBLISH more."""
    keys = Keys("batch-end")
    intake = JobIntake(quiet_redis, keys, ttl_s=60)
    quiet_redis.hset(keys.waiting_bytes, mapping={"m:1": 10, "m:2": 3})  # as admission counted them
    jobs = [f"{i:032x}" for i in range(8)]
    for i, job in enumerate(jobs):
        extra = {"callback_url": "http://127.0.0.1:9/hook"} if i % 2 else {}
        model = "m:2" if i == 7 else "m:1"
        intake.create(job, b"u", 60, {"model": model, "bytes": 1, "deadline_at": 1e12, **extra})
    ensure_library(quiet_redis)
    pubsub = quiet_redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.job_events, keys.callback_outbox)
    ended = commands_of(
        quiet_redis, lambda: intake.finish_many([(job, SUCCEEDED, {"result": {"detections": []}}) for job in jobs])
    )
    assert ended["publish"] == 2 and ended["rpush"] == 1 and ended["hset"] == 8, ended
    # two HMGETs a job not pushed yet (its upload's return reads model, bytes and marker); a pushed job's one (below)
    assert ended["hmget"] == 16 and ended["zrem"] == 1 and ended["hincrby"] == 2, ended
    waiting = {k.decode(): int(v) for k, v in quiet_redis.hgetall(keys.waiting_bytes).items()}
    assert waiting == {"m:1": 3, "m:2": 2}
    messages = [wait_until(lambda: pubsub.get_message(timeout=0.1), 5, what="a message") for _ in range(2)]
    by_channel = {m["channel"].decode(): m["data"].decode().split() for m in messages}
    assert by_channel == {keys.job_events: jobs, keys.callback_outbox: jobs[1::2]}
    assert [job.decode() for job in quiet_redis.lrange(keys.callback_outbox, 0, -1)] == jobs[1::2]
    assert all(intake.load(job)["callback"]["status"] == "pending" for job in jobs[1::2])
    assert all("callback" not in intake.load(job) for job in jobs[::2])
    pubsub.close()


def test_the_api_wakes_every_waiter_a_batchs_one_message_names_and_no_other(quiet_redis):
    from app.waiters import JobEventListener

    listener = JobEventListener(quiet_redis, "wake-test")
    waiting = {job: listener.register(job) for job in ("a" * 32, "b" * 32, "c" * 32)}
    try:
        assert quiet_redis.publish("wake-test", f"{'a' * 32} {'c' * 32}") == 1
        assert waiting["a" * 32].wait(5) and waiting["c" * 32].wait(5)
        assert not waiting["b" * 32].is_set()
        quiet_redis.publish("wake-test", "b" * 32)  # one id alone, as a single end (or an older worker) says it
        assert waiting["b" * 32].wait(5)
    finally:
        listener.close()


def test_admission_without_bulk_shards_reads_no_count_of_frames_on_them(quiet_redis):
    """The admission adds the frames waiting on bulk shards to a model's backlog: an HGET an image, which a deployment
    without shards (make run's) skips. With shards the count is read and counted."""
    from contract.admission.budget import WaitingBytes

    keys = Keys("admit-cost")
    waiting = WaitingBytes(quiet_redis, keys)
    ensure_library(quiet_redis)
    quiet_redis.hset(keys.frames_waiting, "m:1", 5)  # as a sharded deployment's GPU worker would count them
    admitted = commands_of(quiet_redis, lambda: waiting.admit("m:1", 10, 5, 100, 100, sharded=False))
    # FCALL LLEN x2 HGETALL (the models' counters: the total is their sum) HINCRBY (the model's alone)
    assert "hget" not in admitted and sum(admitted.values()) == 5, admitted
    assert waiting.admit("m:1", 10, 5, 100, 100, sharded=True).verdict == "backlog"  # the 5 on shards fill it
    assert waiting.admit("m:1", 10, 5, 100, 100, sharded=False).verdict == "admitted"


def test_a_worker_loads_the_push_step_before_its_first_push_so_no_frame_is_pushed_twice(quiet_redis):
    """On a fresh Redis the first push met NOSCRIPT after its LPUSH; a GPU worker took that frame before the push
    took it back, and the push made again put a second frame of the job in the same batch (a newcomer saw
    `"size": 2` with one job id twice). The library is loaded at every process's start: no error, one frame."""
    keys = Keys("preload")
    intake = JobIntake(quiet_redis, keys, ttl_s=60)
    handoff = JobHandOff(quiet_redis, keys, ttl_s=60)
    job = "f1" * 16
    intake.create(job, b"upload", 60, {"model": "m:1", "bytes": 6, "deadline_at": 1e12})
    assert handoff.claim_for_preprocessing(job, 1.0, "c")[0] == "claimed"
    ensure_library(quiet_redis)  # every process's check at its start
    quiet_redis.config_resetstat()
    assert frame_pusher(quiet_redis, keys).push(job, "m:1", b"the frame", 10, {}, "c") == frames.PUSHED
    assert not quiet_redis.info("errorstats")
    assert quiet_redis.lrange(keys.frames("m:1"), 0, -1) == [b"the frame"]


def test_a_cache_hit_costs_two_round_trips_and_stores_no_copy_of_its_answer(quiet_redis):
    """A hit is the lookup's round trip, then its own step (contract.jobs.hits). Its record refers to the shared
    answer instead of holding a copy (an HSET of the whole answer a hit, and the answer sent as an argument), for
    the bucket that charges its key (GET, SET), the look for the shared answer (EXISTS) and its lifetime
    (EXPIRE), and no DEL of an upload a hit never had: 15 commands a hit before, 17 now; the first hit of an answer
    copies it (STRLEN, COPY)."""
    from contract.admission import budget
    from contract.jobs.hits import HitLimits

    keys = Keys("hit-cost")
    intake = JobIntake(quiet_redis, keys, ttl_s=60, hits=HitLimits(10**6, 60, 600))
    ensure_library(quiet_redis)
    quiet_redis.set(keys.cache_entry("d"), '{"detections":[]}', ex=60)
    request = budget.AdmissionRequest("m:1", 6, max_backlog=10, max_model_bytes=100, max_all_bytes=100)
    fields = {"model": "m:1", "received_at": 1.0, "deadline_at": 1e12, "bytes": 6}

    def hit(job: str) -> None:
        assert intake.answer_or_admit(job, fields, "d", 60, {"total": 1.0}, request, "team-a").status == SUCCEEDED

    first = commands_of(quiet_redis, lambda: hit("a1" * 16))
    again = commands_of(quiet_redis, lambda: hit("a2" * 16))
    assert again["fcall"] == 2 and "copy" not in again and "del" not in again, again
    assert sum(again.values()) == 17, again
    assert first["copy"] == 1 and first["strlen"] == 1 and sum(first.values()) == 19, first


def test_an_api_keys_share_of_the_byte_budgets_costs_a_keyed_image_three_commands_and_no_round_trip(quiet_redis):
    """A key's uploads are counted under the key in the steps that count the model's (contract.admission.budget): the
    admission reads the key's counters and moves one, the push moves one; no step sends anything more, and an
    image without a key pays nothing for it."""
    from contract.admission.budget import WaitingBytes

    keys = Keys("key-share-cost")
    waiting = WaitingBytes(quiet_redis, keys)
    intake = JobIntake(quiet_redis, keys, ttl_s=60)
    handoff = JobHandOff(quiet_redis, keys, ttl_s=60)
    pusher = frame_pusher(quiet_redis, keys)
    ensure_library(quiet_redis)
    shares = {"max_owner_model_bytes": 100, "max_owner_all_bytes": 100}
    plain = commands_of(quiet_redis, lambda: waiting.admit("m:1", 6, 5, 100, 100, sharded=False, **shares))
    keyed = commands_of(quiet_redis, lambda: waiting.admit("m:1", 6, 5, 100, 100, sharded=False, owner="a", **shares))
    # FCALL LLEN x2 HGETALL HINCRBY; with a key, its HGETALL and HINCRBY too
    assert sum(plain.values()) == 5 and sum(keyed.values()) == 7, (plain, keyed)
    assert keyed["hgetall"] == 2 and keyed["hincrby"] == 2, keyed
    for job, owner in (("e1" * 16, ""), ("e2" * 16, "a")):
        record = {"model": "m:1", "bytes": 6, "deadline_at": 1e12, **({"owner": owner} if owner else {})}
        intake.create(job, b"upload", 60, record)
        assert handoff.claim_for_preprocessing(job, 1.0, "c")[0] == "claimed"
    plain_push = commands_of(quiet_redis, lambda: pusher.push("e1" * 16, "m:1", b"frame", 10, {}, "c"))
    keyed_push = commands_of(quiet_redis, lambda: pusher.push("e2" * 16, "m:1", b"frame", 10, {}, "c"))
    assert sum(plain_push.values()) == 9 and sum(keyed_push.values()) == 10, (plain_push, keyed_push)
    assert keyed_push["hincrby"] == 2 and keyed_push["fcall"] == 1, keyed_push
    assert waiting.waiting("a") == {"m:1": 0, "*": 0}


def test_the_end_of_a_pushed_job_reads_its_record_once(quiet_redis):
    """A job past its push (queued_gpu, running: the GPU worker's batch ends) has no upload left: its end reads the
    four fields it needs in one HMGET, nothing for an upload's return."""
    keys = Keys("pushed-end")
    intake = JobIntake(quiet_redis, keys, ttl_s=60)
    jobs = [f"{i:032x}" for i in range(4)]
    for job in jobs:
        intake.create(job, b"u", 60, {"model": "m:1", "bytes": 1, "deadline_at": 1e12})
    ensure_library(quiet_redis)
    assert intake.advance_many(jobs, RUNNING, 0) == [1, 1, 1, 1]
    ended = commands_of(quiet_redis, lambda: intake.finish_many([(job, SUCCEEDED, {}) for job in jobs]))
    assert ended["hmget"] == 4 and ended["hset"] == 4 and "del" not in ended, ended
    assert all(quiet_redis.hget(keys.job(job), "status") == b"succeeded" for job in jobs)
