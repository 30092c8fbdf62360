"""Signed callbacks: URL safety, the signature, delivery with retries, at most once."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import yaml

from bench.stack.receivers import Receiver as SlowReceiver
from contract.callbacks import CallbackRefused, check_callback_url, resolve_callback_url
from contract.callbacks.callback_signature import sign
from contract.documents import JobDocument
from contract.redis.keys import Keys
from tasks.callbacks.http_client import Deadline, post_within
from tests.conftest import CALLBACK_SECRET
from tests.support import free_port, jpeg, wait_until


def fake_resolver(*addresses: str, calls: list | None = None):
    def resolve(host, port, **_):
        if calls is not None:
            calls.append(host)
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses
        ]

    return resolve


@pytest.mark.parametrize(
    "url,address",
    [
        ("file:///etc/passwd", "8.8.8.8"),
        ("ftp://example.com/x", "8.8.8.8"),
        ("http://127.0.0.1/hook", "127.0.0.1"),
        ("http://inside.example/hook", "10.1.2.3"),
        ("http://metadata.example/latest", "169.254.169.254"),
        ("http://sneaky.example/", "192.168.0.7"),
        ("http://[::1]/hook", "::1"),
        ("http://cgnat.example/", "100.64.0.1"),
        ("http://zero.example/", "0.0.0.0"),
        ("http://v6-mapped.example/", "::ffff:169.254.169.254"),
        ("http://nat64.example/", "64:ff9b::a9fe:a9fe"),
        ("http://6to4.example/", "2002:a00:1::1"),
        ("http://ula.example/", "fd00::1"),
    ],
)
def test_unsafe_callback_targets_are_refused(url, address):
    with pytest.raises(CallbackRefused):
        check_callback_url(url, (), resolve=fake_resolver(address))


def test_a_host_is_refused_when_any_of_its_addresses_is_private():
    with pytest.raises(CallbackRefused, match="10.0.0.5"):
        check_callback_url("http://mixed.example/", (), resolve=fake_resolver("93.184.216.34", "10.0.0.5"))


# The two URLs that reached other hosts than the one checked, and their kin.
@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254\\@127.0.0.1:8291/",
        "http://127.0.0.2:8292\\@93.184.215.14/",
        "http://93.184.215.14\\.example.com/",
        "http://user:pass@hooks.example.com/",
        "http://hooks.example.com@10.0.0.1/",
        "http://@hooks.example.com/",
        "http://hooks.example.com/#frag",
        "http://hooks.example.com/a b",
        "http://hooks.example.com/\x00",
        "http://h\u00f6oks.example.com/",
        "HTTP://hooks.example.com:0/",
        "http:/x",
        "http://hooks.example.com:99999/",
        "javascript://hooks.example.com/",
        "http://-bad-.example.com/",
    ],
)
def test_urls_another_parser_would_read_differently_are_refused_before_any_lookup(url):
    calls: list = []
    with pytest.raises(CallbackRefused):
        check_callback_url(url, (), resolve=fake_resolver("93.184.216.34", calls=calls))
    assert calls == []


PRIVATE = ["127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0"]


def numeric_forms(address: str) -> list[str]:
    """The forms of an IPv4 address that some resolvers accept: decimal, octal, hex, mixed, v6-mapped."""
    parts = [int(p) for p in address.split(".")]
    value = int.from_bytes(bytes(parts), "big")
    return [
        str(value),
        ".".join(f"0{p:o}" for p in parts),
        ".".join(f"0x{p:x}" for p in parts),
        f"0x{value:x}",
        f"{parts[0]}.{int.from_bytes(bytes(parts[1:]), 'big')}",
        f"0{value:o}",
        f"[::ffff:{address}]",
    ]


@pytest.mark.parametrize("address", PRIVATE)
def test_every_form_of_a_private_address_is_refused(address):
    for form in [address, *numeric_forms(address)]:
        resolve = socket.getaddrinfo  # the real resolver: whatever it makes of the form, it is refused
        with pytest.raises(CallbackRefused):
            check_callback_url(f"http://{form}:8080/hook", (), resolve=resolve)


def test_public_targets_and_allowlisted_ones_pass():
    check_callback_url("https://hooks.example.com/x?a=1&b=%20", (), resolve=fake_resolver("93.184.216.34"))
    check_callback_url("http://inside.example/hook", ("10.0.0.0/8",), resolve=fake_resolver("10.1.2.3"))
    check_callback_url("http://127.0.0.1:9/hook", ("127.0.0.1",), resolve=fake_resolver("127.0.0.1"))
    target = resolve_callback_url("HTTPS://Hooks.Example.com:8443", (), resolve=fake_resolver("93.184.216.34"))
    assert (target.url.scheme, target.url.host, target.url.port, target.url.target) == (
        "https",
        "hooks.example.com",
        8443,
        "/",
    )
    assert target.url.host_header == "hooks.example.com:8443" and target.address == "93.184.216.34"


def test_an_allow_list_entry_with_a_port_admits_that_port_only():
    """`127.0.0.1` admitted a callback to a local Redis's port; `127.0.0.1:8080` admits the receiver alone."""
    local = fake_resolver("127.0.0.1")
    check_callback_url("http://127.0.0.1:8080/hook", ("127.0.0.1:8080",), resolve=local)
    with pytest.raises(CallbackRefused, match="loopback"):
        check_callback_url("http://127.0.0.1:6379/", ("127.0.0.1:8080",), resolve=local)
    check_callback_url("http://inside.example:8443/", ("[fd00::/8]:8443",), resolve=fake_resolver("fd00::5"))
    with pytest.raises(CallbackRefused):
        check_callback_url("http://inside.example:22/", ("[fd00::/8]:8443",), resolve=fake_resolver("fd00::5"))
    check_callback_url("https://hooks.internal/x", ("hooks.internal:443",), resolve=fake_resolver("10.0.0.7"))
    check_callback_url("http://10.1.2.3:9000/", ("10.0.0.0/8:9000",), resolve=fake_resolver("10.1.2.3"))


@pytest.mark.parametrize(
    "url",
    ["http://[", "http://example.com:99999/", "http://" + "a" * 70 + ".com/", "http://\udcff/", "http://:80/", 42],
)
def test_malformed_callback_urls_are_refused_not_raised(url):
    with pytest.raises(CallbackRefused):
        check_callback_url(url, ())


def test_delivery_connects_to_the_address_it_checked_with_the_urls_host(monkeypatch):
    """One lookup, then the connection goes to that address: a name that would resolve elsewhere
    the second time (DNS rebinding) is never looked up again."""
    receiver = Receiver()
    calls: list = []
    real = socket.getaddrinfo

    def no_more_lookups(host, *args, **kwargs):
        assert host == "127.0.0.1", f"looked {host!r} up again"
        return real(host, *args, **kwargs)

    try:
        target = resolve_callback_url(
            f"http://receiver.test:{receiver.port}/hook?x=1",
            ("127.0.0.1/32",),
            resolve=fake_resolver("127.0.0.1", calls=calls),
        )
        monkeypatch.setattr(socket, "getaddrinfo", no_more_lookups)
        status = post_within(target, b"{}", {"Content-Type": "application/json"}, Deadline(5.0), 1024)
    finally:
        receiver.stop()
    assert status == 200 and calls == ["receiver.test"]
    [call] = receiver.calls
    assert call["headers"]["Host"] == f"receiver.test:{receiver.port}" and call["path"] == "/hook?x=1"


def verify(secret: str, headers: dict, body: bytes, max_age_s: int = 300) -> bool:
    """What the receiver in docs/operations.md does (less its replay cache)."""
    timestamp, job_id = headers["X-Imgserve-Timestamp"], headers["X-Imgserve-Job-Id"]
    message = f"{timestamp}.{job_id}.".encode() + body
    expected = "sha256=" + hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return (
        hmac.compare_digest(expected, headers["X-Signature"])
        and abs(time.time() - int(timestamp)) <= max_age_s
        and json.loads(body)["id"] == job_id
    )


def test_signature_covers_the_timestamp_the_job_id_and_the_body():
    signature = sign("s3cret-s3cret-s3cret", "1700000000", "j1", b'{"id":"j1"}')
    headers = {"X-Imgserve-Timestamp": "1700000000", "X-Imgserve-Job-Id": "j1", "X-Signature": signature}
    assert verify("s3cret-s3cret-s3cret", headers, b'{"id":"j1"}', max_age_s=10**10)
    assert not verify(
        "s3cret-s3cret-s3cret", {**headers, "X-Imgserve-Timestamp": "1700000001"}, b'{"id":"j1"}', max_age_s=10**10
    )
    assert not verify("s3cret-s3cret-s3cret", {**headers, "X-Imgserve-Job-Id": "j2"}, b'{"id":"j1"}', max_age_s=10**10)
    assert not verify("other-other-other-other", headers, b'{"id":"j1"}', max_age_s=10**10)


class Receiver:
    """A test receiver on 127.0.0.1 that fails its first `failures` calls with 500."""

    def __init__(self, failures: int = 0) -> None:
        self.calls: list[dict] = []
        self.failures = failures
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.calls.append({"body": body, "headers": dict(self.headers), "path": self.path})
                status = 500 if len(receiver.calls) <= receiver.failures else 200
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}/hook"

    def stop(self) -> None:
        self.server.shutdown()


def _still_queued(stack, job_id: str) -> bool:
    from contract.redis.keys import CALLBACK_QUEUE

    entries = [
        *stack.redis.lrange(stack.keys.callback_outbox, 0, -1),
        *stack.redis.zrange(stack.keys.callback_relaying, 0, -1),
        *stack.redis.lrange(stack.keys.celery_queue(CALLBACK_QUEUE), 0, -1),
        *(held for key in stack.redis.scan_iter(stack.keys.celery_holds("*")) for held in stack.redis.hvals(key)),
        *(
            held
            for key in stack.redis.scan_iter(stack.keys.celery_held("*"))
            for held in stack.redis.lrange(key, 0, -1)
        ),
    ]
    return any(job_id.encode() in entry for entry in entries)


@pytest.mark.integration
def test_a_signed_callback_arrives_once_and_verifies(stack):
    receiver = Receiver()
    try:
        job_id = stack.submit_ok(jpeg(320, 240), callback_url=receiver.url)
        assert stack.wait_terminal(job_id)["status"] == "succeeded"
        doc = wait_until(
            lambda: (d := stack.job(job_id))["callback"]["status"] == "delivered" and d,
            30,
            what="the callback to be delivered",
        )
        # A second POST could only come from an entry still queued somewhere: the outbox, the callbacks
        # queue, or a message a worker holds (a retry waits there). None may name the job.
        wait_until(lambda: not _still_queued(stack, job_id), 10, what="no delivery of the job left queued")
    finally:
        receiver.stop()
    assert len(receiver.calls) == 1 and doc["callback"]["attempts"] == 1
    call = receiver.calls[0]
    assert verify(CALLBACK_SECRET, call["headers"], call["body"])
    sent = json.loads(call["body"])
    assert sent["id"] == job_id and sent["status"] == "succeeded" and sent["result"]["detections"]
    assert JobDocument.model_validate(sent).to_json() == sent  # the document the OpenAPI describes
    logged = wait_until(
        lambda: [
            entry
            for line in stack.callback_worker.log_path.read_text().splitlines()
            if line.startswith("{") and (entry := json.loads(line)).get("job_id") == job_id
        ],
        10,
        what="the callback worker's line about the job",
    )
    assert logged[0]["role"] == "callback-worker" and logged[0]["outcome"] == "delivered"


@pytest.mark.integration
def test_a_failing_receiver_is_retried_with_backoff(stack):
    receiver = Receiver(failures=2)
    try:
        job_id = stack.submit_ok(jpeg(320, 240), callback_url=receiver.url)
        doc = wait_until(
            lambda: (d := stack.job(job_id)).get("callback", {}).get("status") == "delivered" and d,
            60,
            what="delivery after two failures",
        )
    finally:
        receiver.stop()
    assert len(receiver.calls) == 3 and doc["callback"]["attempts"] == 3
    assert [json.loads(c["body"])["id"] for c in receiver.calls] == [job_id] * 3


@pytest.mark.integration
def test_a_receiver_away_is_retried_until_it_is_back_and_a_dead_letter_can_be_sent_again(stack):
    """Attempts keep coming with backoff while the receiver fails (the stack gives a callback 3 attempts, 0.2 s
    apart at first); past them the callback is the dead letter, and POST /v1/jobs/<id>/callback sends it again
    with the same delivery id."""
    receiver = Receiver(failures=10**6)
    try:
        job_id = stack.submit_ok(jpeg(320, 240), callback_url=receiver.url)
        dead = wait_until(
            lambda: (d := stack.job(job_id)).get("callback", {}).get("status") == "failed" and d,
            60,
            what="the callback to be given up",
        )
        assert dead["callback"]["attempts"] == 3 and "500" in dead["callback"]["last_error"]
        assert stack.redis.zscore(stack.keys.callback_dead, job_id) is not None
        receiver.failures = 0  # the receiver is back
        again = stack.session.post(stack.url(f"/v1/jobs/{job_id}/callback"), timeout=10)
        # Queued again: the callback worker may already have taken it by the time the API reads the job back.
        assert again.status_code == 202 and again.json()["callback"]["status"] in ("pending", "delivering", "delivered")
        doc = wait_until(
            lambda: (d := stack.job(job_id))["callback"]["status"] == "delivered" and d,
            30,
            what="the redelivered callback",
        )
    finally:
        receiver.stop()
    assert doc["callback"]["attempts"] == 1 and stack.redis.zscore(stack.keys.callback_dead, job_id) is None
    ids = {call["headers"]["X-Imgserve-Delivery-Id"] for call in receiver.calls}
    assert len(receiver.calls) == 4 and ids == {f"{job_id}.succeeded"}  # one id for every attempt
    no_callback = stack.submit_ok(jpeg(64, 64))
    stack.wait_terminal(no_callback)
    assert stack.session.post(stack.url(f"/v1/jobs/{no_callback}/callback"), timeout=10).status_code == 409


@pytest.mark.integration
def test_every_dead_letter_can_be_sent_again_at_once(stack):
    receiver = Receiver(failures=10**6)
    try:
        jobs_ = [stack.submit_ok(jpeg(64, 64, seed=i), callback_url=receiver.url) for i in range(2)]
        for job_id in jobs_:
            wait_until(
                lambda: stack.job(job_id).get("callback", {}).get("status") == "failed",
                60,
                what="the callbacks to be given up",
            )
        receiver.failures = 0
        answer = stack.session.post(stack.url("/v1/callbacks/redeliver"), timeout=10)
        assert answer.status_code == 200 and answer.json()["redelivered"] >= 2
        for job_id in jobs_:
            wait_until(lambda: stack.job(job_id)["callback"]["status"] == "delivered", 30, what="redelivery")
    finally:
        receiver.stop()


@pytest.mark.integration
def test_a_callback_worker_killed_during_a_delivery_has_it_sent_again_and_it_never_stays_pending(stack):
    """The receiver holds the first POST; the callback worker is SIGKILLed meanwhile. Its task is given back once
    its heartbeat lapses (tasks.hop.recovery) and a new worker delivers, with the same delivery id."""
    import signal

    from bench.stack.processes import ManagedProcess, callback_worker_argv

    hold = threading.Event()
    receiver = Receiver()
    original = receiver.server.RequestHandlerClass.do_POST

    def held_post(handler):
        if not receiver.calls:
            hold.wait(30)
        original(handler)

    receiver.server.RequestHandlerClass.do_POST = held_post
    worker = stack.callback_worker
    try:
        job_id = stack.submit_ok(jpeg(64, 64), callback_url=receiver.url)
        wait_until(
            lambda: stack.job(job_id).get("callback", {}).get("status") == "delivering",
            30,
            what="the delivery to start",
        )
        os.killpg(worker.process.pid, signal.SIGKILL)
        worker.stop()
        hold.set()
        stack.callback_worker = ManagedProcess(
            "callback-worker",
            callback_worker_argv(),
            stack.env,
            stack.log_dir,
        )
        doc = wait_until(
            lambda: (d := stack.job(job_id))["callback"]["status"] == "delivered" and d,
            60,
            what="the delivery to be made again by another worker",
        )
    finally:
        hold.set()
        receiver.stop()
    assert doc["callback"]["attempts"] == 2
    ids = [call["headers"]["X-Imgserve-Delivery-Id"] for call in receiver.calls]
    assert len(ids) == 2 and len(set(ids)) == 1  # the receiver can tell the repeat


@pytest.mark.integration
def test_unsafe_callback_url_is_400_at_submit(stack):
    response = stack.submit(jpeg(64, 64), callback_url="http://169.254.169.254/latest/meta-data")
    assert response.status_code == 400
    assert response.json()["invalid_params"][0]["name"] == "callback_url"


def keyed_settings(tmp_path, monkeypatch):
    from app.auth import hash_key
    from contract.settings.config import load_settings

    monkeypatch.setenv("TEAM_A_CALLBACK_SECRET", "team-a-callback-secret-0123")
    (tmp_path / "team-b.secret").write_text("team-b-callback-secret-4567\n")
    config = tmp_path / "keyed.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "namespace": "keyed",
                "callbacks": {"secret": "global-callback-secret-89ab", "allow_hosts": ["127.0.0.1"]},
                "auth": {
                    "api_keys": [
                        {"id": "team-a", "sha256": hash_key("a"), "callback_secret_env": "TEAM_A_CALLBACK_SECRET"},
                        {
                            "id": "team-b",
                            "sha256": hash_key("b"),
                            "callback_secret_file": str(tmp_path / "team-b.secret"),
                        },
                        {"id": "team-c", "sha256": hash_key("c")},
                    ]
                },
            }
        )
    )
    return load_settings(config)


def test_each_api_key_signs_its_callbacks_with_its_own_secret(redis_client, tmp_path, monkeypatch):
    from contract.callbacks import callback_secret
    from contract.jobs.ending import JobEnding
    from contract.jobs.record import SUCCEEDED
    from contract.redis.keys import Keys
    from tasks.callbacks.delivery import CallbackSender

    settings = keyed_settings(tmp_path, monkeypatch)
    assert callback_secret(settings, "team-a") == "team-a-callback-secret-0123"
    assert callback_secret(settings, "team-b") == "team-b-callback-secret-4567"
    assert callback_secret(settings, "team-c") is None and callback_secret(settings, None) is None
    receiver = Receiver()
    store = JobEnding(redis_client, Keys("keyed"), 60)
    sender = CallbackSender(settings, redis_client)
    try:
        outcomes = {}
        for owner in ("team-a", "team-b", "team-c"):
            job_id = f"job-of-{owner}"
            redis_client.hset(
                Keys("keyed").job(job_id),
                mapping={
                    "id": job_id,
                    "status": "running",
                    "owner": owner,
                    "callback_url": receiver.url,
                    "received_at": 1.0,
                },
            )
            store.finish(
                job_id,
                SUCCEEDED,
                {
                    "result": {
                        "detections": [],
                        "image": {"width": 1, "height": 1},
                        "model": {"name": "m", "version": "1"},
                    }
                },
            )
            outcomes[owner] = sender.deliver(job_id)
    finally:
        receiver.stop()
    assert outcomes == {"team-a": "delivered", "team-b": "delivered", "team-c": "failed"}
    first, second = receiver.calls
    assert verify("team-a-callback-secret-0123", first["headers"], first["body"])
    assert not verify("global-callback-secret-89ab", first["headers"], first["body"])  # not the global one
    assert verify("team-b-callback-secret-4567", second["headers"], second["body"])
    assert (
        "no callback secret"
        in json.loads(redis_client.hget(Keys("keyed").job("job-of-team-c"), "callback"))["last_error"]
    )


@pytest.mark.parametrize("secret", ["change-me", "change-me-to-a-long-random-string", "short", "a" * 40])
def test_a_placeholder_or_short_callback_secret_stops_every_process_at_start(secret, monkeypatch):
    from contract.settings.config import load_settings
    from contract.settings.sections import SettingsError

    monkeypatch.setenv("IMGSERVE_CALLBACK_SECRET", secret)
    with pytest.raises(SettingsError, match="callback secret"):
        load_settings()


def test_a_placeholder_redis_password_stops_every_process_at_start(monkeypatch):
    from contract.settings.config import load_settings
    from contract.settings.sections import SettingsError

    monkeypatch.setenv("IMGSERVE_REDIS_URL", "redis://:change-me@redis:6379/0")
    with pytest.raises(SettingsError, match="Redis password"):
        load_settings()
    monkeypatch.setenv("IMGSERVE_REDIS_URL", "redis://:Kx8f2-pQz71_mW3vT9rLs@redis:6379/0")
    assert load_settings().redis_url.endswith("@redis:6379/0")


def test_api_key_entries_name_their_secret_never_hold_it(tmp_path):
    from contract.settings.config import load_settings
    from contract.settings.sections import SettingsError

    config = tmp_path / "inline.yaml"
    config.write_text(yaml.safe_dump({"auth": {"api_keys": [{"id": "a", "sha256": "00", "callback_secret": "x"}]}}))
    with pytest.raises(SettingsError, match="callback_secret_env or callback_secret_file"):
        load_settings(config)


def test_the_relay_loses_nothing_when_the_broker_refuses_a_task(redis_client):
    from tasks.callbacks.relay import relay_outbox

    keys = Keys("relay-fails")
    redis_client.rpush(keys.callback_outbox, "job-a", "job-b")

    def broker_down(job_id: str) -> None:
        raise ConnectionError("broker unreachable")

    with pytest.raises(ConnectionError):
        relay_outbox(redis_client, keys, broker_down)
    assert redis_client.lrange(keys.callback_outbox, 0, -1) == [b"job-a", b"job-b"]  # back at the head
    assert redis_client.zcard(keys.callback_relaying) == 0
    sent: list[str] = []
    assert relay_outbox(redis_client, keys, sent.append) == 2
    assert sent == ["job-a", "job-b"]
    assert redis_client.llen(keys.callback_outbox) == 0 and redis_client.zcard(keys.callback_relaying) == 0


def test_an_entry_held_by_a_relay_that_died_is_relayed_again(redis_client):
    from tasks.callbacks.relay import RELAY_STALE_AFTER_S, relay_outbox

    keys = Keys("relay-died")
    redis_client.zadd(
        keys.callback_relaying,
        {"held-by-the-dead": time.time() - RELAY_STALE_AFTER_S - 1, "in-flight-elsewhere": time.time()},
    )
    sent: list[str] = []
    relay_outbox(redis_client, keys, sent.append)
    assert sent == ["held-by-the-dead"]
    assert redis_client.zrange(keys.callback_relaying, 0, -1) == [b"in-flight-elsewhere"]


def test_a_late_delivery_record_does_not_recreate_an_expired_job(redis_client):
    import dataclasses

    from contract.settings.config import load_settings
    from tasks.callbacks.delivery import CallbackSender

    settings = dataclasses.replace(load_settings(), namespace="late-record")
    sender = CallbackSender(settings, redis_client)
    sender._record("f" * 32, {"status": "delivered", "attempts": 1, "last_error": None})
    assert not redis_client.exists(sender.keys.job("f" * 32))


def test_the_wait_between_attempts_doubles_to_its_cap_within_its_jitter():
    from tasks.callbacks.delivery import backoff_s

    plain = [backoff_s(n, 1.0, 3600.0, 0.0, 0.5) for n in range(1, 15)]
    assert plain[:4] == [1.0, 2.0, 4.0, 8.0] and plain[-1] == 3600.0 and max(plain) == 3600.0
    assert backoff_s(3, 1.0, 3600.0, 0.2, 0.0) == pytest.approx(3.2)  # 4 s, 20% early
    assert backoff_s(3, 1.0, 3600.0, 0.2, 0.999999) == pytest.approx(4.8)  # 4 s, 20% late
    total = sum(backoff_s(n, 1.0, 3600.0, 0.0, 0.5) for n in range(1, 24))  # the defaults: 23 waits
    assert 12 * 3600 < total < 24 * 3600  # retried for most of a day


def test_a_retry_is_scheduled_in_redis_and_the_relay_hands_it_over_when_due(redis_client):
    from tasks.callbacks.relay import relay_outbox

    keys = Keys("scheduled")
    now = time.time()
    redis_client.zadd(keys.callback_scheduled, {"due": now - 1, "later": now + 60})
    sent: list[str] = []
    relay_outbox(redis_client, keys, sent.append)
    assert sent == ["due"] and redis_client.zrange(keys.callback_scheduled, 0, -1) == [b"later"]


def test_a_receiver_away_longer_than_the_old_fifteen_seconds_still_gets_its_callback(redis_client):
    """The old schedule gave up after 1+2+4+8 s; this one keeps trying for a day. Scaled down (0.1 s doubling,
    the receiver away 1.5 s), the same code path: the sender schedules each retry in Redis, the relay hands
    it back when due, and the callback is delivered once the receiver is back."""
    import dataclasses

    from contract.jobs.ending import JobEnding
    from contract.jobs.record import SUCCEEDED
    from contract.settings.config import load_settings
    from tasks.callbacks.delivery import CallbackSender
    from tasks.callbacks.relay import relay_outbox

    base = load_settings()
    settings = dataclasses.replace(
        base,
        namespace="outage",
        callbacks=dataclasses.replace(
            base.callbacks, secret=CALLBACK_SECRET, allow_hosts=("127.0.0.1",), backoff_base_s=0.1, backoff_max_s=0.4
        ),
    )
    keys = Keys("outage")
    receiver = Receiver(failures=10**6)
    sender = CallbackSender(settings, redis_client)
    store = JobEnding(redis_client, keys, 60)
    redis_client.hset(
        keys.job("j" * 32),
        mapping={
            "id": "j" * 32,
            "status": "running",
            "callback_url": receiver.url,
            "received_at": time.time(),  # retries stop jobs.max_ttl_s after it
            "deadline_at": 1e12,
        },
    )
    store.finish(
        "j" * 32,
        SUCCEEDED,
        {"result": {"detections": [], "image": {"width": 1, "height": 1}, "model": {"name": "m", "version": "1"}}},
    )
    back_at = time.monotonic() + 1.5
    outcomes: list[str] = []
    try:
        while not outcomes or outcomes[-1] != "delivered":
            if time.monotonic() > back_at:
                receiver.failures = 0
            relay_outbox(redis_client, keys, lambda job_id: outcomes.append(sender.deliver(job_id)))
            assert time.monotonic() < back_at + 10, outcomes
            time.sleep(0.02)
    finally:
        receiver.stop()
    assert outcomes.count("retrying") >= 3 and "failed" not in outcomes and outcomes[-1] == "delivered"
    state = store.load("j" * 32)["callback"]
    assert state["status"] == "delivered" and state["attempts"] == len(outcomes)


@pytest.mark.integration
def test_six_thousand_redelivery_requests_send_the_receiver_one_callback_at_a_time(stack):
    """6,000 POST /v1/jobs/<id>/callback in 16.5 s sent the same job to its receiver 2,978 times, and another
    tenant's callbacks waited up to 3.1 s behind them. Against a receiver that takes 1.5 s to answer, 600
    requests in that time get a 202 naming the delivery on its way, and the receiver sees it once."""
    receiver = SlowReceiver(delay_s=1.5)
    try:
        job_id = stack.submit_ok(jpeg(64, 48), callback_url=receiver.url)
        wait_until(lambda: job_id in receiver.arrived, 30, what="the first callback")
        wait_until(lambda: stack.job(job_id)["callback"]["status"] == "delivered", 30, what="it to be recorded")
        # That delivery was a while ago (a redelivery in the 10 s after one answers with it): the receiver lost it.
        state = json.loads(stack.redis.hget(stack.keys.job(job_id), "callback"))
        stack.redis.hset(stack.keys.job(job_id), "callback", json.dumps({**state, "delivered_at": time.time() - 60}))
        first = len(receiver.calls)
        session = requests.Session()
        statuses, seen = [], set()
        started = time.monotonic()
        for _ in range(600):
            answer = session.post(stack.url(f"/v1/jobs/{job_id}/callback"), timeout=10)
            statuses.append(answer.status_code)
            seen.add(answer.json()["callback"]["status"])
            if time.monotonic() - started > 1.2:  # within the first redelivery's attempt
                break
        wait_until(lambda: stack.job(job_id)["callback"]["status"] == "delivered", 30, what="the redelivery")
        assert stack.redis.llen(stack.keys.callback_outbox) == 0
    finally:
        receiver.stop()
    assert set(statuses) == {202} and seen <= {"pending", "delivering", "delivered"}, (set(statuses), seen)
    assert len(receiver.calls) - first == 1, len(receiver.calls) - first
    assert len(statuses) > 20  # the loop ran: many requests, one delivery
