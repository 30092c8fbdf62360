"""Hostile callback receivers (issue 40, finding 1): a receiver that sends its headers and then a byte every
second, one that trickles its headers, one that never answers, over http and https. An attempt ends at its
deadline whatever the receiver does, and one tenant's receivers hold its own slots, never another tenant's:
its callbacks wait in Redis while another's are delivered."""

from __future__ import annotations

import json
import time

import pytest
import requests
import yaml

from app import create_app
from app.auth import hash_key
from bench.stack.processes import ManagedProcess, callback_worker_argv
from bench.stack.receivers import Gauge, Receiver, Tarpit
from contract.callbacks import resolve_callback_url
from contract.redis.keys import Keys
from tasks.callbacks.http_client import Deadline, DeliveryFailed, post_within
from tasks.callbacks.slots import LAPSE_MARGIN_S, TenantSlots
from tests.support import ApiServer, jpeg, wait_until

DEADLINE_S = 3.0
MARGIN_S = 3.0  # what a busy 2-core machine may add to an attempt's end, beyond its deadline


@pytest.mark.parametrize(
    "mode,scheme", [("trickle", "http"), ("trickle-headers", "http"), ("silent", "http"), ("silent", "https")]
)
def test_an_attempt_ends_at_its_deadline_whatever_the_receiver_does(mode, scheme):
    """Each read waited at most the timeout, so a byte a second held the attempt as long as the receiver cared
    to: 234 s in the probe. The tarpit would go on for a minute; the attempt ends at its deadline (here shorter
    than the timeout of each wait, so that only the deadline can end it)."""
    tarpit = Tarpit(mode, interval_s=1.0)
    target = resolve_callback_url(tarpit.url.replace("http", scheme, 1), ("127.0.0.1",))
    started = time.monotonic()
    try:
        with pytest.raises(DeliveryFailed, match=f"did not answer within {DEADLINE_S:g} s"):
            post_within(target, b"{}", {"Content-Type": "application/json"}, Deadline(DEADLINE_S, 10.0), 65536)
        taken = time.monotonic() - started
        [visit] = wait_until(
            lambda: [v for v in tarpit.visits if v.closed is not None], 10, what="the tarpit to see the attempt hang up"
        )
    finally:
        tarpit.stop()
    assert DEADLINE_S - 0.1 <= taken < DEADLINE_S + MARGIN_S, taken
    assert visit.closed_by_client  # the service hung up: the tarpit had a minute to go
    if mode == "trickle":
        assert visit.sent >= 1  # it was mid-answer: headers sent, the body trickling


def test_a_tenants_slots_hold_its_excess_in_redis_and_each_one_given_back_hands_one_on(redis_client):
    keys = Keys("slots")
    slots = TenantSlots(redis_client, keys, cap=2, hold_s=DEADLINE_S)
    first, second = slots.take("key:a", "a1"), slots.take("key:a", "a2")
    assert first and second
    assert slots.take("key:a", "a3") is None and slots.take("key:a", "a4") is None  # held, no thread kept
    assert slots.take("key:b", "b1")  # another tenant's are its own
    assert redis_client.lrange(keys.callback_held("key:a"), 0, -1) == [b"a3", b"a4"]
    slots.give_back("key:a", first)
    assert redis_client.lrange(keys.callback_outbox, 0, -1) == [b"a3"]  # a3's turn
    assert redis_client.lrange(keys.callback_held("key:a"), 0, -1) == [b"a4"]
    third = slots.take("key:a", "a3")  # a3, from the outbox
    assert third and slots.free_lapsed() == 0  # both slots in use: a4 waits
    # Workers that died holding slots: a slot lapses after its deadline and margin, and the relays' sweep hands
    # the held callback on.
    lapsed = time.time() - 1
    redis_client.zadd(keys.callback_slots("key:a"), {second: lapsed, third: lapsed})
    assert slots.free_lapsed() == 1
    assert redis_client.lrange(keys.callback_outbox, 0, -1) == [b"a3", b"a4"]
    assert not redis_client.sismember(keys.callback_held_tenants, "key:a")
    token_until = redis_client.zscore(
        keys.callback_slots("key:b"), redis_client.zrange(keys.callback_slots("key:b"), 0, 0)[0]
    )
    assert token_until <= time.time() + DEADLINE_S + LAPSE_MARGIN_S + 1


KEYS = ({"id": "attacker", "sha256": hash_key("key-attacker")}, {"id": "victim", "sha256": hash_key("key-victim")})
ATTACKERS = 8
CAP = 2


@pytest.fixture(scope="module")
def keyed_callbacks(stack, tmp_path_factory):
    """The stack's callback worker swapped for one with two API keys (each signing with its own secret), a cap of
    2 attempts per key, a deadline of 3 s, and 4 threads; an API with the same keys. The stack's own callback
    worker comes back after the module."""
    workdir = tmp_path_factory.mktemp("keyed-callbacks")
    entries = []
    for entry in KEYS:
        secret = workdir / f"{entry['id']}.secret"
        secret.write_text(f"{entry['id']}-callback-secret-0123456789\n")
        entries.append({**entry, "callback_secret_file": str(secret)})
    config = yaml.safe_load(stack.config_path.read_text())
    config["auth"] = {"api_keys": entries}
    config["callbacks"] = {**config["callbacks"], "max_per_tenant": CAP, "deadline_s": DEADLINE_S}
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    from contract.settings.config import load_settings

    settings = load_settings(path)
    stack.callback_worker.stop()
    worker = ManagedProcess(
        "keyed-callback-worker",
        callback_worker_argv(),
        {**stack.env, "IMGSERVE_CONFIG": str(path)},
        workdir,
    )
    api = None
    try:
        wait_until(lambda: "ready." in worker.log_tail() or not worker.alive(), 60, what="the keyed callback worker")
        assert worker.alive(), worker.log_tail()
        api = ApiServer(create_app(settings))
        yield api, worker
    finally:
        if api is not None:
            api.stop()
        worker.stop()
        stack.callback_worker = ManagedProcess(
            "callback-worker",
            callback_worker_argv(),
            stack.env,
            stack.log_dir,
        )
        wait_until(
            lambda: "ready." in stack.callback_worker.log_tail() or not stack.callback_worker.alive(),
            60,
            what="the stack's callback worker back",
        )


def submit_as(api, key: str, callback_url: str, seed: int) -> str:
    response = requests.post(
        api.url + "/v1/jobs",
        params={"callback_url": callback_url},
        data=jpeg(64, 64, seed=seed),
        headers={"Content-Type": "image/jpeg", "Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 202, response.text
    return response.json()["id"]


def callback_of(api, key: str, job_id: str) -> dict:
    response = requests.get(api.url + f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["callback"]


def ended_visits(tarpits: list[Tarpit]) -> list:
    return [visit for tarpit in tarpits for visit in tarpit.visits if visit.closed is not None]


def test_one_tenants_tarpits_hold_its_own_slots_and_another_tenants_callback_is_delivered_meanwhile(keyed_callbacks):
    """The probe: 16 of one tenant's jobs called back a receiver trickling a byte every 2 s and held all 16
    callback threads for 234 s; another tenant's callback stayed pending all along. Here 8 of the attacker's
    jobs call back two tarpits (one trickling its answer, one silent) that would hold each connection for
    minutes; the worker has 4 threads. The attacker's attempts hold at most its 2 slots, each ends at the 3 s
    deadline, and the victim's callback is delivered while the tarpits still hang."""
    from tests.test_callbacks import verify

    api, _worker = keyed_callbacks
    gauge = Gauge()
    tarpits = [Tarpit("trickle", 1.0, gauge), Tarpit("silent", 1.0, gauge)]
    receiver = Receiver()
    try:
        attacks = [submit_as(api, "key-attacker", tarpits[i % 2].url, seed=i) for i in range(ATTACKERS)]
        wait_until(lambda: gauge.peak >= CAP, 60, what="the attacker's callbacks to reach its tarpits")
        victim = submit_as(api, "key-victim", receiver.url, seed=100)
        # Well within the minute the tarpits would hold 4 threads each: before, the victim waited all of it.
        wait_until(
            lambda: callback_of(api, "key-victim", victim)["status"] == "delivered",
            30,
            what="the victim's callback while the attacker's receivers hang",
        )
        attackers_then = [callback_of(api, "key-attacker", job_id)["status"] for job_id in attacks]
        # The attacker's attempts, meanwhile, end at their deadline and hand their slots on.
        ended = wait_until(
            lambda: len(visits := ended_visits(tarpits)) >= 2 * CAP and visits,
            30,
            what="the attacker's first attempts to end",
        )
    finally:
        for tarpit in tarpits:
            tarpit.stop()
        receiver.stop()
    assert "delivered" not in attackers_then, attackers_then  # the tarpits never let one through
    assert gauge.peak <= CAP, gauge.peak  # at most its slots, over both tarpits
    assert ended and all(visit.closed_by_client and visit.held_s < DEADLINE_S + MARGIN_S for visit in ended), [
        (visit.closed_by_client, round(visit.held_s, 2)) for visit in ended
    ]
    [call] = [call for call in receiver.calls if call["headers"]["X-Imgserve-Job-Id"] == victim]
    assert verify("victim-callback-secret-0123456789", call["headers"], call["body"])
    assert json.loads(call["body"])["status"] == "succeeded"


# --- issue 52, finding 6: redelivery requests queue one delivery at a time --------------------------------------
def ended_job_with_callback(client, keys: Keys, job_id: str, callback: dict | None) -> None:
    fields = {
        "id": job_id,
        "status": "succeeded",
        "callback_url": "http://127.0.0.1:9/hook",
        "finished_at": time.time(),
    }
    if callback is not None:
        fields["callback"] = json.dumps(callback)
    client.hset(keys.job(job_id), mapping=fields)


def places(client, keys: Keys, job_id: str) -> int:
    """How many places the job's delivery waits in: entries of the outbox, the scheduled and dead sets."""
    queued = [entry.decode() for entry in client.lrange(keys.callback_outbox, 0, -1)].count(job_id)
    return queued + sum(client.zscore(key, job_id) is not None for key in (keys.callback_scheduled, keys.callback_dead))


def test_a_redelivery_while_one_is_on_its_way_queues_nothing(redis_client):
    from contract.jobs.ending import (
        DELIVERED_COOLDOWN_S,
        IN_FLIGHT_STALE_S,
        REDELIVER_IN_FLIGHT,
        REDELIVER_QUEUED,
        JobEnding,
    )

    keys = Keys("redeliver52")
    store = JobEnding(redis_client, keys, 3600)
    job = "a" * 32
    ended_job_with_callback(redis_client, keys, job, {"status": "delivered", "attempts": 1, "last_error": None})
    assert store.redeliver_callback(job) == REDELIVER_QUEUED
    assert [store.redeliver_callback(job) for _ in range(100)] == [REDELIVER_IN_FLIGHT] * 100
    assert redis_client.llen(keys.callback_outbox) == 1  # 100 requests: still one
    # Under way (an attempt recorded `delivering`): nothing more either; a dead letter is queued again, once.
    for state, first in (("delivering", REDELIVER_IN_FLIGHT), ("failed", REDELIVER_QUEUED)):
        redis_client.delete(keys.callback_outbox)
        callback = {"status": state, "attempts": 3, "last_error": "x", "attempt_at": time.time()}
        ended_job_with_callback(redis_client, keys, job, callback)
        if state == "failed":
            redis_client.zadd(keys.callback_dead, {job: time.time()})
        assert store.redeliver_callback(job) == first
        assert store.redeliver_callback(job) == REDELIVER_IN_FLIGHT
        assert places(redis_client, keys, job) == (0 if state == "delivering" else 1)
    # Waiting for its retry: moved to the outbox (still one); once a relay took it from there, on its way.
    redis_client.delete(keys.callback_outbox)
    retrying = {"status": "retrying", "attempts": 1, "last_error": "x", "next_attempt_at": time.time() + 60}
    ended_job_with_callback(redis_client, keys, job, retrying)
    redis_client.zadd(keys.callback_scheduled, {job: time.time() + 60})
    assert store.redeliver_callback(job) == REDELIVER_QUEUED and places(redis_client, keys, job) == 1
    redis_client.delete(keys.callback_outbox)
    ended_job_with_callback(redis_client, keys, job, {**retrying, "next_attempt_at": time.time() - 1})
    assert store.redeliver_callback(job) == REDELIVER_IN_FLIGHT and places(redis_client, keys, job) == 0
    # On its way for longer than IN_FLIGHT_STALE_S: taken for lost (its Celery message gone), queued again.
    stale = {"status": "pending", "attempts": 0, "last_error": None, "queued_at": time.time() - IN_FLIGHT_STALE_S - 5}
    ended_job_with_callback(redis_client, keys, job, stale)
    assert store.redeliver_callback(job) == REDELIVER_QUEUED and places(redis_client, keys, job) == 1
    # Delivered a moment ago: that delivery answers (a prompt receiver's key had its job posted 2,033 times in
    # 16.5 s, one after another); once the cooldown has passed, queued again.
    delivered = {"status": "delivered", "attempts": 1, "last_error": None, "delivered_at": time.time()}
    redis_client.delete(keys.callback_outbox)
    ended_job_with_callback(redis_client, keys, job, delivered)
    assert store.redeliver_callback(job) == REDELIVER_IN_FLIGHT and places(redis_client, keys, job) == 0
    ended_job_with_callback(
        redis_client, keys, job, {**delivered, "delivered_at": time.time() - DELIVERED_COOLDOWN_S - 1}
    )
    assert store.redeliver_callback(job) == REDELIVER_QUEUED and places(redis_client, keys, job) == 1
    # The first delivery, from the job's end: on its way since the job ended.
    other = "b" * 32
    ended_job_with_callback(redis_client, keys, other, {"status": "pending", "attempts": 0, "last_error": None})
    assert store.redeliver_callback(other) == REDELIVER_IN_FLIGHT
