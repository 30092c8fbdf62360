"""Signed callbacks: URL safety, the signature, delivery with retries, at most once."""
from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from contract.documents import JobDocument
from tasks.callbacks import CallbackRefused, check_callback_url, sign
from tests.conftest import CALLBACK_SECRET
from tests.support import free_port, jpeg, wait_until


def fake_resolver(address: str):
    return lambda host, port, **_: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]


@pytest.mark.parametrize("url,address", [
    ("file:///etc/passwd", "8.8.8.8"), ("ftp://example.com/x", "8.8.8.8"),
    ("http://127.0.0.1/hook", "127.0.0.1"), ("http://inside.example/hook", "10.1.2.3"),
    ("http://metadata.example/latest", "169.254.169.254"), ("http://sneaky.example/", "192.168.0.7"),
    ("http://[::1]/hook", "::1"),
])
def test_unsafe_callback_targets_are_refused(url, address):
    with pytest.raises(CallbackRefused):
        check_callback_url(url, (), resolve=fake_resolver(address))


def test_public_targets_and_allowlisted_ones_pass():
    check_callback_url("https://hooks.example.com/x", (), resolve=fake_resolver("93.184.216.34"))
    check_callback_url("http://inside.example/hook", ("10.0.0.0/8",), resolve=fake_resolver("10.1.2.3"))
    check_callback_url("http://127.0.0.1:9/hook", ("127.0.0.1",), resolve=fake_resolver("127.0.0.1"))


@pytest.mark.parametrize("url", ["http://[", "http://example.com:99999/", "http://" + "a" * 70 + ".com/",
                                 "http://\udcff/", "http://:80/"])
def test_malformed_callback_urls_are_refused_not_raised(url):
    with pytest.raises(CallbackRefused):
        check_callback_url(url, ())


def verify(secret: str, timestamp: str, body: bytes, signature: str, max_age_s: int = 300) -> bool:
    """What the README's receiver does."""
    expected = "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, signature) and abs(time.time() - int(timestamp)) <= max_age_s


def test_signature_is_hmac_of_timestamp_and_body():
    signature = sign("s3cret", "1700000000", b'{"a":1}')
    assert verify("s3cret", "1700000000", b'{"a":1}', signature, max_age_s=10 ** 10)
    assert not verify("s3cret", "1700000001", b'{"a":1}', signature, max_age_s=10 ** 10)
    assert not verify("other", "1700000000", b'{"a":1}', signature, max_age_s=10 ** 10)


class Receiver:
    """A test receiver on 127.0.0.1 that fails its first `failures` calls with 500."""

    def __init__(self, failures: int = 0) -> None:
        self.calls: list[dict] = []
        self.failures = failures
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.calls.append({"body": body, "headers": dict(self.headers)})
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


@pytest.mark.integration
def test_a_signed_callback_arrives_once_and_verifies(stack):
    receiver = Receiver()
    try:
        job_id = stack.submit_ok(jpeg(320, 240), callback_url=receiver.url)
        assert stack.wait_terminal(job_id)["status"] == "succeeded"
        doc = wait_until(lambda: (d := stack.job(job_id))["callback"]["status"] == "delivered" and d, 30,
                         what="the callback to be delivered")
        time.sleep(1.0)   # nothing more arrives
    finally:
        receiver.stop()
    assert len(receiver.calls) == 1 and doc["callback"]["attempts"] == 1
    call = receiver.calls[0]
    assert verify(CALLBACK_SECRET, call["headers"]["X-Imgserve-Timestamp"], call["body"],
                  call["headers"]["X-Signature"])
    sent = json.loads(call["body"])
    assert sent["id"] == job_id and sent["status"] == "succeeded" and sent["result"]["detections"]
    assert JobDocument.model_validate(sent).to_json() == sent   # the document the OpenAPI describes
    logged = wait_until(lambda: [entry for line in stack.callback_worker.log_path.read_text().splitlines()
                                 if line.startswith("{") and (entry := json.loads(line)).get("job_id") == job_id],
                        10, what="the callback worker's line about the job")
    assert logged[0]["role"] == "callback-worker" and logged[0]["outcome"] == "delivered"


@pytest.mark.integration
def test_a_failing_receiver_is_retried_with_backoff(stack):
    receiver = Receiver(failures=2)
    try:
        job_id = stack.submit_ok(jpeg(320, 240), callback_url=receiver.url)
        doc = wait_until(lambda: (d := stack.job(job_id)).get("callback", {}).get("status") == "delivered" and d,
                         60, what="delivery after two failures")
    finally:
        receiver.stop()
    assert len(receiver.calls) == 3 and doc["callback"]["attempts"] == 3
    assert [json.loads(c["body"])["id"] for c in receiver.calls] == [job_id] * 3


@pytest.mark.integration
def test_unsafe_callback_url_is_400_at_submit(stack):
    response = stack.submit(jpeg(64, 64), callback_url="http://169.254.169.254/latest/meta-data")
    assert response.status_code == 400
    assert response.json()["invalid_params"][0]["name"] == "callback_url"
