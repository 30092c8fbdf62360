"""Issue 59.4: fairness between API keys was per task, not per CPU-second. One key kept three at-cap 16-bit Adam7
PNGs in flight (2-3 CPU-s each) and held every CPU child, while another key's photos waited 25-46 s in its own
queue (some refused 429, its share of the backlog full). Now an expensive decode is charged to its key before it
is queued (contract.admission.decode_share): past `auth.max_decode_bytes_in_flight` the key is refused 429 unless it has
none in flight, so its files take one child at a time and the other key's photos find one free."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections import Counter

import pytest
import requests
import yaml

from app import create_app
from app.auth import hash_key
from bench.hostile.files import png_rgba16_adam7
from bench.stack.processes import ManagedProcess, cpu_worker_argv
from contract.admission.decode_share import CHARGED_FROM, MIB, DecodeShare, decode_cost
from contract.jobs.timebill import percentile
from contract.redis.keys import Keys
from tests.support import ApiServer, encode, jpeg, make_image, wait_until

KEYS = ({"id": "heavy", "sha256": hash_key("key-heavy")}, {"id": "photos", "sha256": hash_key("key-photos")})
TERMINAL = {"succeeded", "failed", "expired", "cancelled"}
probe_png = functools.cache(png_rgba16_adam7)  # 3 s to build: once


# --- the estimate and the charges -----------------------------------------------------------------------------
def test_the_estimate_weighs_bit_depth_and_interlacing_from_the_header():
    honest = encode(make_image(64, 32, "RGBA"), "PNG")
    assert decode_cost(honest) == 64 * 32 * 4
    assert decode_cost(png_rgba16_adam7(64, 32)) == int(64 * 32 * 8 * 1.5)  # two bytes a sample, Adam7
    assert decode_cost(probe_png()) == 768 * MIB  # the probe's file: three times an honest 8192² RGBA
    assert decode_cost(jpeg(64, 64)) == 0 and decode_cost(b"\x89PNG\r\n\x1a\n") == 0  # not weighed here


def test_a_key_holds_its_share_then_is_refused_and_lapsed_charges_free_it(redis_client):
    share = DecodeShare(redis_client, Keys("decode-share-test"))
    redis_client.delete(Keys("decode-share-test").decode_share)
    big = 768 * MIB
    assert share.take("a", "j1", big, 256 * MIB, now=100.0, lapse_at=200.0).taken  # none in flight: always taken
    refused = share.take("a", "j2", CHARGED_FROM, 256 * MIB, now=101.0, lapse_at=200.0)
    assert not refused.taken and refused.held == big
    assert share.take("b", "j3", big, 256 * MIB, now=101.0, lapse_at=200.0).taken  # another key's share is its own
    share.release("j1")
    assert share.take("a", "j2", CHARGED_FROM, 256 * MIB, now=102.0, lapse_at=200.0).taken
    assert share.take("a", "j4", big, 256 * MIB, now=250.0, lapse_at=400.0).taken  # j2 lapsed: a worker died
    assert share.held() == {"a": big}


# --- the attack, through the stack -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_worker(stack, tmp_path_factory):
    """A CPU worker (two children) with the keys in its config: it takes each key's own queues."""
    workdir = tmp_path_factory.mktemp("fair-decode-worker")
    config = yaml.safe_load(stack.config_path.read_text())
    config["auth"] = {"api_keys": [dict(entry) for entry in KEYS]}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    worker = ManagedProcess(
        "fair-decode-cpu-worker",
        cpu_worker_argv(2, loglevel="INFO"),
        {**stack.env, "IMGSERVE_CONFIG": str(workdir / "config.yaml")},
        workdir,
    )
    wait_until(lambda: "ready." in worker.log_tail() or not worker.alive(), 60, what="the keyed CPU worker")
    assert worker.alive(), worker.log_tail()
    yield worker
    worker.stop()


def _headers(key: str, media_type: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": media_type}


def _follow(session: requests.Session, url: str, job_id: str, key: str, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        doc = session.get(f"{url}/v1/jobs/{job_id}", params={"wait": 5}, headers=_headers(key, ""), timeout=30).json()
        if doc["status"] in TERMINAL:
            return doc
    raise AssertionError(f"job {job_id} did not end within {within_s} s")


def test_one_keys_expensive_pngs_in_flight_leave_another_keys_photos_a_child(stack, keyed_worker):
    """The probe's attack, shortened: key `heavy` keeps three 16-bit Adam7 8192² PNGs in flight (each sent again
    once it ended, or after its Retry-After when refused) while key `photos` sends a photo every 0.25 s. The
    photos are all admitted and wait little for a CPU child (before: 2 s and more at p95 here, every child
    decoding a PNG); the PNGs still decode, one at a time, the others refused with a 429 that says why."""
    auth = dataclasses.replace(stack.settings.auth, rate_per_s=0.0, api_keys=KEYS)
    server = ApiServer(create_app(dataclasses.replace(stack.settings, auth=auth)))
    expensive = probe_png()
    stop = threading.Event()
    heavy: Counter[str] = Counter()
    problems: list[tuple[dict, str]] = []

    def keep_in_flight() -> None:
        session = requests.Session()
        while not stop.is_set():
            response = session.post(
                server.url + "/v1/jobs", data=expensive, headers=_headers("key-heavy", "image/png"), timeout=60
            )
            if response.status_code == 429:
                problems.append((response.json(), response.headers.get("Content-Type", "")))
                heavy["refused"] += 1
                stop.wait(float(response.headers["Retry-After"]))  # the client's manners, not a synchronisation
                continue
            assert response.status_code == 202, response.text
            heavy[_follow(session, server.url, response.json()["id"], "key-heavy", 120)["status"]] += 1

    attackers = [threading.Thread(target=keep_in_flight, daemon=True) for _ in range(3)]
    photos: list[str] = []
    codes: Counter[int] = Counter()
    try:
        for thread in attackers:
            thread.start()
        wait_until(lambda: heavy["refused"] > 0 or heavy["succeeded"] > 0, 60, what="the attack to be under way")
        session = requests.Session()
        next_at = time.monotonic()
        for i in range(40):  # 10 s of photos at 4/s
            response = session.post(
                server.url + "/v1/jobs",
                data=jpeg(640, 480, seed=i),
                headers=_headers("key-photos", "image/jpeg"),
                timeout=30,
            )
            codes[response.status_code] += 1
            if response.status_code == 202:
                photos.append(response.json()["id"])
            next_at += 0.25
            stop.wait(max(0.0, next_at - time.monotonic()))  # pacing the client, as bench hostile does
        docs = [_follow(session, server.url, job_id, "key-photos", 60) for job_id in photos]
    finally:
        stop.set()
        for thread in attackers:
            thread.join(150)
        server.stop()
    assert codes == Counter({202: 40}), codes  # none of the photos refused
    assert all(doc["status"] == "succeeded" for doc in docs), Counter(doc["status"] for doc in docs)  # before: expired
    waits = sorted(doc["timings_ms"]["queue_cpu"] for doc in docs)
    assert percentile(waits, 95) < 1000, waits  # before: every child decoding a PNG, seconds behind them
    assert heavy["succeeded"] >= 2, heavy  # the expensive files still decode, one after another
    assert set(heavy) <= {"succeeded", "refused"}, heavy
    for problem, content_type in problems:
        assert content_type.startswith("application/problem+json")
        assert problem["type"] == "/problems/overloaded" and "your share in flight is 256 MiB" in problem["detail"]
    keys = stack.keys
    wait_until(lambda: not stack.redis.hlen(keys.decode_share), 10, what="every charge to be given back")
