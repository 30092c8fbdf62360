"""API keys, per-key visibility and the per-key rate limit, over real HTTP.
A second API with keys configured serves the same queues as the stack's."""

from __future__ import annotations

import dataclasses

import pytest
import requests
import yaml

from app import create_app
from app.admission import failure_source
from app.auth import hash_key
from app.services import services as api_services
from bench.stack.processes import ManagedProcess, cpu_worker_argv
from tests.support import ApiServer, api_with_keys, as_key, jpeg, wait_until

pytestmark = pytest.mark.integration


KEYS = (
    {"id": "team-a", "sha256": hash_key("key-a")},
    {"id": "team-b", "sha256": hash_key("key-b")},
    {"id": "team-c", "sha256": hash_key("key-c")},
    {"id": "ops", "sha256": hash_key("key-ops"), "admin": True},
)


@pytest.fixture(scope="module")
def keyed_worker(stack, tmp_path_factory):
    """A CPU worker with the keys in its config: it takes each key's own queue (the stack's takes the plain one)."""
    workdir = tmp_path_factory.mktemp("keyed-worker")
    config = yaml.safe_load(stack.config_path.read_text())
    config["auth"] = {"api_keys": [dict(entry) for entry in KEYS]}
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    worker = ManagedProcess(
        "keyed-cpu-worker",
        cpu_worker_argv(2, loglevel="INFO"),
        {**stack.env, "IMGSERVE_CONFIG": str(path)},
        workdir,
    )
    wait_until(lambda: "ready." in worker.log_tail() or not worker.alive(), 60, what="the keyed CPU worker")
    assert worker.alive(), worker.log_tail()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def keyed_api(stack, keyed_worker):
    with api_with_keys(stack.settings, KEYS, rate_per_s=2.0, burst=3.0) as server:
        yield server


def test_without_a_key_v1_is_refused_but_health_stays_open(keyed_api):
    for headers in (as_key(None), as_key("wrong")):
        response = requests.post(
            keyed_api.url + "/v1/jobs", data=jpeg(64, 64), timeout=10, headers={"Content-Type": "image/jpeg", **headers}
        )
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(keyed_api.url + "/healthz", timeout=10).status_code == 200
    assert requests.get(keyed_api.url + "/readyz", timeout=10).status_code == 200


def test_a_job_is_visible_only_to_the_key_that_created_it(keyed_api, stack):
    response = requests.post(
        keyed_api.url + "/v1/jobs",
        data=jpeg(64, 64),
        timeout=10,
        headers={"Content-Type": "image/jpeg", **as_key("key-a")},
    )
    assert response.status_code == 202
    job_url = keyed_api.url + response.json()["links"]["self"]
    mine = requests.get(job_url, params={"wait": 20}, headers=as_key("key-a"), timeout=40)
    assert mine.status_code == 200 and mine.json()["status"] == "succeeded"
    theirs = requests.get(job_url, headers=as_key("key-b"), timeout=10)
    assert theirs.status_code == 404
    assert requests.delete(job_url, headers=as_key("key-b"), timeout=10).status_code == 404


def test_each_key_has_its_own_token_bucket(keyed_api):
    statuses = [requests.get(keyed_api.url + "/v1/models", headers=as_key("key-b"), timeout=10) for _ in range(6)]
    limited = [r for r in statuses if r.status_code == 429]
    assert limited and int(limited[0].headers["Retry-After"]) >= 1
    assert limited[0].json()["type"] == "/problems/rate-limited"
    assert requests.get(keyed_api.url + "/v1/models", headers=as_key("key-a"), timeout=10).status_code == 200


def test_only_an_admin_key_sees_every_tenants_traffic(keyed_api):
    tenant = requests.get(keyed_api.url + "/v1/stats", headers=as_key("key-c"), timeout=10)
    assert tenant.status_code == 403 and tenant.json()["type"] == "/problems/forbidden"
    admin = requests.get(keyed_api.url + "/v1/stats", headers=as_key("key-ops"), timeout=10)
    assert admin.status_code == 200 and "queues" in admin.json()


def test_the_rate_limit_holds_under_concurrent_clients(stack):
    """50 connections at once, each one request: at most the burst (and what the rate refills meanwhile) gets
    through. With each API process's own clock in the bucket, 75 got through against a bound of 50."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    auth = dataclasses.replace(
        stack.settings.auth, rate_per_s=5.0, burst=20.0, api_keys=({"id": "racer", "sha256": hash_key("key-race")},)
    )
    servers = [ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth))) for _ in range(2)]
    stack.redis.delete(stack.keys.rate_bucket("racer"))
    try:

        def one(i: int) -> int:
            return requests.get(servers[i % 2].url + "/v1/models", headers=as_key("key-race"), timeout=30).status_code

        started = time.monotonic()
        with ThreadPoolExecutor(50) as pool:
            codes = list(pool.map(one, range(150)))
        elapsed = time.monotonic() - started
    finally:
        for server in servers:
            server.stop()
    allowed = codes.count(200)
    assert set(codes) <= {200, 429} and codes.count(429) > 0
    assert allowed <= 20 + 5.0 * elapsed + 1, (allowed, elapsed)


def test_an_address_that_keeps_failing_to_authenticate_is_throttled(stack):
    auth = dataclasses.replace(
        stack.settings.auth,
        failed_per_s=1.0,
        failed_burst=5.0,
        api_keys=({"id": "real", "sha256": hash_key("key-real")},),
    )
    server = ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth)))
    stack.redis.delete(stack.keys.auth_failures("127.0.0.1"))
    try:
        guesses = [requests.get(server.url + "/v1/models", headers=as_key(f"guess-{i}"), timeout=10) for i in range(30)]
        real = requests.get(server.url + "/v1/models", headers=as_key("key-real"), timeout=10)
    finally:
        server.stop()
    codes = [r.status_code for r in guesses]
    assert codes[:5] == [401] * 5 and 429 in codes and codes.count(401) <= 8
    throttled = next(r for r in guesses if r.status_code == 429)
    assert throttled.json()["type"] == "/problems/too-many-failed-authentications"
    assert int(throttled.headers["Retry-After"]) >= 1
    assert real.status_code == 200  # a right key is never what the throttle counts


def test_one_keys_flood_neither_delays_nor_refuses_another_keys_jobs(stack, keyed_worker):
    """Each key has its own CPU queue, taken in turn, and may fill only its share of a model's backlog
    (auth.max_backlog_share): a flood from team-a gets team-a 429s, while team-b's jobs pass it by.
    The keyed worker is paused until team-a's share is full, so the flood is a full one on any machine
    (on a fast one the worker kept up with the flood and the share never filled)."""
    import signal
    import threading
    import time
    from collections import Counter

    from contract.jobs.timebill import percentile

    auth = dataclasses.replace(stack.settings.auth, rate_per_s=0.0, api_keys=KEYS)
    # team-a's share: 80 jobs. Its jobs the worker moved on also count on the model's frame list (max_frames,
    # 64): 80 + 64 stays below 160, so the model's own limit never refuses team-b.
    pressure = dataclasses.replace(stack.settings.backpressure, max_backlog=160)
    assert pressure.max_frames + 80 < pressure.max_backlog
    server = ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth, backpressure=pressure)))
    stop = threading.Event()
    codes: Counter[int] = Counter()
    flood_ids: list[str] = []

    def flood() -> None:
        session = requests.Session()
        while not stop.is_set():
            response = session.post(
                server.url + "/v1/jobs",
                data=jpeg(320, 240),
                timeout=30,
                headers={"Content-Type": "image/jpeg", **as_key("key-a")},
            )
            codes[response.status_code] += 1
            if response.status_code == 202:
                flood_ids.append(response.json()["id"])

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    quiet = []
    keyed_worker.signal(signal.SIGSTOP)  # for less than celery.heartbeat_ttl_s: it stays a live worker of team-a's
    paused = True
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: codes[429] > 0, 6, what="team-a's share of the backlog to fill")
        keyed_worker.signal(signal.SIGCONT)
        paused = False
        for i in range(20):
            response = requests.post(
                server.url + "/v1/jobs",
                data=jpeg(320, 240, seed=i),
                timeout=30,
                headers={"Content-Type": "image/jpeg", **as_key("key-b")},
            )
            assert response.status_code == 202, response.text  # never refused for team-a's flood
            quiet.append(response.json()["id"])
            time.sleep(0.2)
    finally:
        if paused:
            keyed_worker.signal(signal.SIGCONT)
        stop.set()
        for thread in threads:
            thread.join()
    try:
        docs = [
            requests.get(
                f"{server.url}/v1/jobs/{job_id}", params={"wait": 30}, headers=as_key("key-b"), timeout=60
            ).json()
            for job_id in quiet
        ]
        for job_id in flood_ids:  # drain team-a's before the next test
            requests.get(f"{server.url}/v1/jobs/{job_id}", params={"wait": 30}, headers=as_key("key-a"), timeout=60)
    finally:
        server.stop()
    waits = sorted(doc["timings_ms"]["queue_cpu"] for doc in docs if doc["status"] == "succeeded")
    print(f"team-b's queue_cpu p95 {percentile(waits, 95):.0f} ms beside team-a's flood {dict(codes)}")
    assert len(waits) == 20 and codes[202] >= 80
    assert percentile(waits, 95) < 1500  # behind itself, not behind team-a's 80 waiting jobs


def test_a_key_no_cpu_worker_takes_yet_is_served_from_the_shared_queue(stack, keyed_worker):
    """A key added to the API before the CPU workers were restarted with it: its jobs go where a worker takes
    them (the shared queue), not to a queue of its own that nobody reads, while known keys keep theirs."""
    new_key = {"id": "team-new", "sha256": hash_key("key-new")}
    auth = dataclasses.replace(stack.settings.auth, rate_per_s=0.0, api_keys=(*KEYS, new_key))
    server = ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth)))
    try:
        keys = api_services(server.app).keys
        wait_until(
            lambda: stack.redis.hexists(keys.cpu_tenants, "team-b"),
            30,
            what="the keyed worker's heartbeat naming its keys",
        )
        for key in ("key-new", "key-b"):
            response = requests.post(
                server.url + "/v1/jobs",
                data=jpeg(64, 64),
                timeout=30,
                headers={"Content-Type": "image/jpeg", **as_key(key)},
            )
            assert response.status_code == 202, response.text
            done = requests.get(
                f"{server.url}/v1/jobs/{response.json()['id']}", params={"wait": 30}, headers=as_key(key), timeout=60
            ).json()
            assert done["status"] == "succeeded", done
        assert not stack.redis.hexists(keys.cpu_tenants, "team-new")
    finally:
        server.stop()


def test_failed_authentications_count_per_ipv6_64_and_from_every_address_together(stack):
    """A host holds a whole IPv6 /64, and guesses spread over many addresses (40 loopback ones got 40 buckets):
    an address counts as its /64, and every address's failures fill one more bucket together."""
    auth = dataclasses.replace(
        stack.settings.auth, failed_per_s=0.01, failed_burst=3.0, failed_total_per_s=0.01, failed_total_burst=20.0
    )
    app = create_app(dataclasses.replace(stack.settings, auth=auth))
    admission = api_services(app).admission
    for source in ("2001:db8:1:2::/64", "*", *(f"127.0.0.{i}" for i in range(1, 41))):
        stack.redis.delete(stack.keys.auth_failures(source))
    same_64 = [admission.failed_authentication(f"2001:db8:1:2::{i:x}") for i in range(1, 6)]
    assert [p is None for p in same_64] == [True, True, True, False, False]  # one bucket of 3 for the /64
    assert admission.failed_authentication("2001:db8:1:3::1") is None  # the next /64 is another source
    spread = [admission.failed_authentication(f"127.0.0.{i}") for i in range(1, 41)]
    refused = [p for p in spread if p is not None]
    assert len(refused) == 40 - (20 - 4), len(refused)  # 20 in all together, 4 of them taken above
    assert refused[0].status == 429 and refused[0].slug == "too-many-failed-authentications"
    assert failure_source("::ffff:10.1.2.3") == "10.1.2.3" and failure_source("not-an-address") == "not-an-address"
