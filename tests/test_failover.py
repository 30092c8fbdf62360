"""The control plane behind Sentinel (settings.redis): every process follows a failover, a 202 waits until a
replica holds the job, and the primary SIGKILLed under load loses no accepted job. Real redis-servers and
Sentinels (tools.redis_ha), make run's own processes (bench.stack.local.ProcfileStack), real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bench.stack.processes import RedisServer, wait_until
from contract.admission import budget
from contract.jobs.intake import JobIntake
from contract.redis.connection import connect
from contract.redis.keys import Keys
from contract.redis.replication import NotReplicated, Replication, execute_and_wait
from contract.redis.replies import PayloadReader
from contract.settings.config import load_settings
from tests.support import REPO_ROOT, jpeg
from tools.redis_ha import SERVERS, RedisHA

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisHA]:
    redis_set = RedisHA(tmp_path_factory.mktemp("ha")).start()
    yield redis_set
    redis_set.stop()


@pytest.fixture
def sentinel_settings(ha: RedisHA, monkeypatch: pytest.MonkeyPatch):
    for key, value in ha.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("IMGSERVE_CONFIG", raising=False)
    return load_settings()


def test_a_sentinel_client_writes_to_the_primary_and_a_202s_write_reaches_a_replica(ha, sentinel_settings):
    client = connect(sentinel_settings, socket_timeout=2.0)
    primary = ha.wait_settled(30)
    assert client.connection_pool.get_master_address()[1] == ha.nodes[primary].port
    replies, acknowledged = execute_and_wait(client, [("MULTI",), ("SET", "durable", "1"), ("EXEC",)], 2, 2000)
    assert replies[-1] == [b"OK"] and acknowledged == 2  # both replicas hold it
    for name in ("a", "b", "c"):
        node = redis.Redis(port=ha.nodes[name].port)
        wait_until(lambda n=node: n.get("durable") == b"1", 5, what=f"{name} to hold the write")


def test_a_job_too_few_replicas_acknowledge_is_withdrawn_and_refused(tmp_path):
    """A plain server has no replica: asked for one, create() stores the job, WAIT finds none, and the job ends
    `failed` (not_replicated) so that no worker spends anything on what the client was told to send again."""
    server = RedisServer(tmp_path)
    try:
        client, keys = redis.Redis(port=server.port), Keys("replicas")
        store = JobIntake(client, keys, 60, replication=Replication(1, 50))
        with pytest.raises(NotReplicated) as caught:
            store.create("j1", b"upload", 60, {"model": "m:1", "bytes": 6, "deadline_at": time.time() + 30})
        assert caught.value.acknowledged == 0
        record = store.load("j1")
        assert record["status"] == "failed" and record["error"]["code"] == "not_replicated"
        assert not client.exists(keys.upload("j1"))
        assert client.lrange(keys.callback_outbox, 0, -1) == []
    finally:
        server.stop()


def test_a_payload_connection_that_meets_a_replica_finds_the_primary_again(tmp_path):
    """redis-py reconnects a closed connection to the address it had, and a dedicated connection that a failover
    left on a server now a replica got READONLY for every write (the GPU worker stayed stuck there for good)."""
    (tmp_path / "primary").mkdir()
    (tmp_path / "replica").mkdir()
    primary = RedisServer(tmp_path / "primary")
    replica = RedisServer(tmp_path / "replica", extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    try:
        reader = PayloadReader(redis.Redis(port=replica.port))
        with pytest.raises(redis.ConnectionError, match="READONLY"):
            reader.execute(("SET", "k", "v"))
        assert reader.connection is None  # dropped: the next call takes one through the pool
        assert reader.execute(("GET", "k")) == [None]  # and it works
    finally:
        replica.stop()
        primary.stop()


def test_a_channel_with_a_fanout_queue_closes_when_redis_has_gone(tmp_path):
    """A worker's gossip and control queues are auto-delete fanout queues that the channel's close() unbinds;
    with Redis gone that raised, and Celery logged an AttributeError ("Error on restarting Gossip") on every
    Redis restart. The close now ends, its pools let go."""
    import kombu

    from tasks.hop.broker import TRANSPORT

    server = RedisServer(tmp_path)
    with kombu.Connection(f"redis://127.0.0.1:{server.port}/0", transport=TRANSPORT) as connection:
        channel = connection.channel()
        exchange = kombu.Exchange("gossip-like", type="fanout", auto_delete=True)
        kombu.Queue("gossip-like.worker", exchange, auto_delete=True)(channel).declare()
        assert channel.client.smembers("_kombu.binding.gossip-like")  # bound, and its client cached
        server.stop()
        channel.close()
        assert channel.closed


def test_bytes_that_could_not_be_given_back_are_given_back_once_redis_answers(tmp_path):
    server = RedisServer(tmp_path, persistent=True)
    keys = Keys("unreleased")
    client = redis.Redis(port=server.port)
    waiting = budget.WaitingBytes(client, keys)
    client.hset(keys.waiting_bytes, mapping={"m:1": 1000, budget.ALL: 1000})
    server.stop()
    waiting.release_later("m:1", 400)
    assert waiting.flush_unreleased() == 0  # Redis away: kept
    server.start()
    assert waiting.flush_unreleased() == 1
    assert waiting.waiting() == {"m:1": 600, budget.ALL: 600}
    assert waiting.flush_unreleased() == 0  # once
    server.stop()


def test_a_celery_worker_gives_back_a_message_it_is_recorded_holding_but_does_not(redis_server):
    """A failover to a replica that missed a task's ack leaves its message 'unacked' and recorded as the live
    worker's: kombu would put it back after visibility_timeout (300 s), past every deadline. Kombu's channel
    (this project's transport) on a real Redis takes two messages; one is in hand, the other not."""
    import kombu

    from tasks.hop.broker import TRANSPORT, holder_id
    from tasks.hop.given_back import UNHELD_GRACE_S, restore_unheld

    keys = Keys("unheld")
    client = redis.Redis.from_url(redis_server.url)
    with kombu.Connection(
        redis_server.url, transport=TRANSPORT, transport_options={"global_keyprefix": keys.celery_prefix}
    ) as connection:
        channel = connection.channel()
        queue = kombu.Queue("unheld-q", kombu.Exchange("unheld-q", type="direct"), "unheld-q")
        producer = kombu.Producer(channel)
        for body in ("lost-ack", "in-hand"):
            producer.publish(body, exchange=queue.exchange, routing_key="unheld-q", declare=[queue])
        taken = [queue(channel).get(no_ack=False) for _ in range(2)]
        tags = {message.payload: str(message.delivery_tag) for message in taken}
        assert client.llen(keys.celery_prefix + "unheld-q") == 0
        assert client.hlen(keys.celery_holds(holder_id())) == 2
        fresh = restore_unheld(client, keys, holder_id(), channel, in_hand=set(), now=time.time())
        assert fresh == 0  # delivered a moment ago: left alone
        later = time.time() + UNHELD_GRACE_S + 1
        assert restore_unheld(client, keys, holder_id(), channel, in_hand={tags["in-hand"]}, now=later) == 1
        assert client.llen(keys.celery_prefix + "unheld-q") == 1  # the one nobody held is back on its queue
        assert client.hkeys(keys.celery_holds(holder_id())) == [tags["in-hand"].encode()]
        channel.qos.ack(tags["in-hand"])


# --- the whole stack through a failover ---------------------------------------------------------------------


def test_the_primary_killed_under_load_loses_no_accepted_job(tmp_path):
    """make run REDIS=sentinel's stack at a steady 15 images/s; the primary SIGKILLed; the old primary back
    six seconds later (a replica now). Every client operation recorded, every 202 followed to its end, the history
    checked (bench.faults.harness, bench.faults.history)."""
    from bench.faults.failover import failover
    from bench.faults.harness import RunOptions, format_verdict, run_scenario
    from bench.stack.local import StackOptions

    options = StackOptions(device="sim", cpu_workers=2, sim_profile_ms={1: 5.0, 8: 20.0})
    images = [jpeg(640, 480, seed=i) for i in range(8)]
    run = RunOptions(qps=15.0, fault_at_s=6.0, after_s=12.0, deadline_ms=60_000, drain_s=90.0)
    verdict = run_scenario(failover(options, back_after_s=6.0), images, run)
    print(format_verdict(verdict))
    assert verdict["accepted"] > 150
    assert verdict["lost"] == 0 and verdict["expired_early"] == 0
    assert verdict["ends"] == {"succeeded": verdict["accepted"]}  # none failed, none expired
    first = verdict["first_202_after_heal_s"]  # after the Sentinels settled
    assert first is not None and first < 10.0
    assert verdict["restarted"] == 0  # every process followed the new primary by itself
    assert verdict["killed_comes_back_as"] == "slave"
    # An answer read before the failover may be re-done once if its write did not reach a replica in time
    # (docs/reliability.md says when); measured here, and rare: the window is the replication lag.
    assert verdict["went_back"] + verdict["ended_twice"] <= max(1, verdict["accepted"] // 100)


def test_a_write_to_the_demoted_primary_is_refused_not_lost(ha, sentinel_settings):
    """No split brain: the old primary, back, is a replica; a client still pointed at it directly is refused
    (READONLY), and a Sentinel client writes to the new primary."""
    ha.wait_settled(30)
    killed = ha.kill_primary()
    assert ha.wait_settled(30) != killed
    ha.restart(killed)
    wait_until(lambda: ha.role(killed) == "slave", 30, what=f"{killed} to come back as a replica")
    stale = redis.Redis(port=ha.nodes[killed].port)
    with pytest.raises(redis.ReadOnlyError):
        stale.set("split", "brain")
    client = connect(sentinel_settings, socket_timeout=2.0)
    client.set("split", "no")
    wait_until(lambda: stale.get("split") == b"no", 10, what="the new primary's write to reach the old one")
    ha.wait_settled(30)


def test_make_run_redis_sentinel_starts_and_stops_the_set(tmp_path):
    """`python -m tools.redis_ha` as run-local uses it: start prints the settings' variables, stop ends all. Each
    server runs with configs/redis.conf's settings, given as options: the file itself, given as a server's config
    file, was rewritten by Sentinel's CONFIG REWRITE with that server's whole state (its port, its replicaof)."""
    conf = (REPO_ROOT / "configs" / "redis.conf").read_bytes()
    folder = tmp_path / "set"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    started = subprocess.run(
        [sys.executable, "-m", "tools.redis_ha", "start", "--dir", str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    stop = [sys.executable, "-m", "tools.redis_ha", "stop", "--dir", str(folder)]
    try:
        assert "export IMGSERVE_REDIS__SENTINELS='[127.0.0.1:" in started.stdout
        ha = RedisHA.load(folder)
        assert all(node.alive() for node in ha.nodes.values()) and ha.primary() == "a"
        for name in SERVERS:
            server = redis.Redis(port=ha.nodes[name].port, password=ha.password or None, decode_responses=True)
            assert server.config_get("hash-max-listpack-entries") == {"hash-max-listpack-entries": "0"}, name
            assert server.info("server")["config_file"] == "", name  # nothing of the checkout's for CONFIG REWRITE
    finally:  # a failed assertion must not leave six servers running after the test
        subprocess.run(stop, env=env, timeout=60, check=True)
    assert not any(node.alive() for node in ha.nodes.values())
    assert (REPO_ROOT / "configs" / "redis.conf").read_bytes() == conf
