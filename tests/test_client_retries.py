"""The client's reading of Retry-After and its retries of a refusal, against a real HTTP server on 127.0.0.1 that
answers as the test scripts it (no stack: these start no process)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest
import requests

from imgserve_client import ApiError, Client, parse_retry_after

NOW = datetime(2026, 12, 6, 21, 0, 0, tzinfo=timezone.utc)  # noqa: UP017 (as the client writes it)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("3", 3.0),
        (" 0 ", 0.0),
        (format_datetime(NOW + timedelta(seconds=5), usegmt=True), 5.0),  # an HTTP-date: from now
        ("Sun, 06 Dec 2026 21:00:07 GMT", 7.0),
        (format_datetime(NOW - timedelta(seconds=5), usegmt=True), 0.0),  # past already: at once
        ("-1", None),
        ("1.5", None),  # delta-seconds are whole
        ("soon", None),
        ("", None),
        (None, None),
    ],
)
def test_retry_after_is_read_as_delta_seconds_or_an_http_date(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header, now=NOW) == seconds


class Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next (status, headers) of the server's script, the last one for ever after."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server = self.server
        time.sleep(getattr(server, "hold_s", 0.0))  # a server that holds each answer before it sends it
        with server.lock:  # type: ignore[attr-defined]
            server.seen += 1  # type: ignore[attr-defined]
            script = server.script  # type: ignore[attr-defined]
            status, headers = script.pop(0) if len(script) > 1 else script[0]
        body = (
            {"id": "a" * 32, "status": "queued"}
            if status == 202
            else {"type": "/problems/overloaded", "title": "Too many requests", "status": status, "detail": "busy"}
        )
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json" if status == 202 else "application/problem+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    server.lock, server.seen, server.script = threading.Lock(), 0, []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def client_of(server: http.server.ThreadingHTTPServer, **bounds: float) -> tuple[Client, list[float]]:
    """A client of the scripted server whose waits are recorded instead of slept."""
    client = Client(f"http://127.0.0.1:{server.server_address[1]}", **bounds)  # type: ignore[arg-type]
    waits: list[float] = []
    client._sleep = waits.append
    return client, waits


def test_a_refused_submission_is_sent_again_after_its_retry_after(scripted):
    scripted.script = [(429, {"Retry-After": "2"}), (503, {"Retry-After": "1"}), (202, {})]
    client, waits = client_of(scripted)
    assert client.submit(b"image")["id"] == "a" * 32
    assert scripted.seen == 3 and client.retried == 2
    assert 2.0 <= waits[0] <= 2.2 and 1.0 <= waits[1] <= 1.1  # as asked, and a little jitter


def test_a_refusal_without_retry_after_backs_off(scripted):
    scripted.script = [(503, {}), (503, {}), (202, {})]
    client, waits = client_of(scripted)
    client.submit(b"image")
    assert 1.0 <= waits[0] <= 1.1 and 2.0 <= waits[1] <= 2.2


def test_the_api_error_carries_the_status_the_problem_the_headers_and_retry_after(scripted):
    scripted.script = [(429, {"Retry-After": "7", "X-Seen": "yes"})]
    client, waits = client_of(scripted, retries=0)
    with pytest.raises(ApiError) as caught:
        client.submit(b"image")
    error = caught.value
    assert (error.status, error.problem["type"], error.retry_after) == (429, "/problems/overloaded", 7.0)
    assert error.headers["x-seen"] == "yes" and error.headers["Retry-After"] == "7"
    assert scripted.seen == 1 and waits == [] and client.retried == 0  # retries=0: never sent again


def test_retries_stop_at_their_count(scripted):
    scripted.script = [(429, {"Retry-After": "1"})]
    client, waits = client_of(scripted, retries=3)
    with pytest.raises(ApiError):
        client.submit(b"image")
    assert scripted.seen == 4 and len(waits) == 3


def test_retries_stop_before_their_waits_pass_the_bound(scripted):
    scripted.script = [(429, {"Retry-After": "4"})]
    client, waits = client_of(scripted, retry_wait_s=10.0)
    with pytest.raises(ApiError) as caught:
        client.submit(b"image")
    assert caught.value.retry_after == 4.0
    assert scripted.seen == 3 and len(waits) == 2  # a third wait of 4 s would pass 10 s in all


def test_refusals_the_server_holds_count_toward_the_bound(scripted):
    # Held 0.4 s each, with Retry-After 0: the waits alone never reach the bound, so before, the call went on for
    # every one of its 20 retries (an outside check's fake server: 21 tries of 8 s, 169 s for one call).
    scripted.script, scripted.hold_s = [(503, {"Retry-After": "0"})], 0.4
    client, waits = client_of(scripted, retry_wait_s=1.5)
    started = time.monotonic()
    with pytest.raises(ApiError):
        client.submit(b"image")
    assert 3 <= scripted.seen <= 5, scripted.seen
    assert time.monotonic() - started < 1.5 + 2 * 0.4 + 1.0


def test_other_errors_are_not_sent_again(scripted):
    scripted.script = [(400, {}), (202, {})]
    client, waits = client_of(scripted)
    with pytest.raises(ApiError) as caught:
        client.submit(b"image")
    assert caught.value.status == 400 and scripted.seen == 1 and waits == []


def test_a_refused_connection_after_an_answer_is_a_restart_sent_again_once_it_is_back(scripted):
    """docs/upgrading.md: a client that retries loses nothing while the only API process restarts."""
    scripted.script = [(202, {})]
    client, waits = client_of(scripted)
    client.submit(b"image")
    host, port = scripted.server_address[:2]
    scripted.shutdown()
    scripted.server_close()  # down: the next connection is refused
    restarted: list[http.server.ThreadingHTTPServer] = []

    def restart_while_waiting(seconds: float) -> None:
        waits.append(seconds)
        if not restarted:
            server = http.server.ThreadingHTTPServer((host, port), Scripted)
            server.lock, server.seen, server.script = threading.Lock(), 0, [(202, {})]  # type: ignore[attr-defined]
            threading.Thread(target=server.serve_forever, daemon=True).start()
            restarted.append(server)

    client._sleep = restart_while_waiting
    try:
        assert client.submit(b"image")["id"] == "a" * 32
    finally:
        for server in restarted:
            server.shutdown()
    assert len(waits) == 1 and restarted[0].seen == 1  # type: ignore[attr-defined]


def test_a_first_refused_connection_is_said_at_once(scripted):
    """A wrong URL or an API not running: no answer yet, so nothing to wait for."""
    client, waits = client_of(scripted)
    scripted.shutdown()
    scripted.server_close()
    with pytest.raises(requests.ConnectionError):
        client.submit(b"image")
    assert waits == []


@pytest.mark.parametrize("body", [b"[" * 200_000 + b"]" * 200_000, b"<html>hello</html>", b"[1, 2]"])
def test_an_answer_that_is_no_api_document_is_an_api_error_not_a_traceback(body: bytes) -> None:
    class Odd(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ApiError) as caught:
            Client(f"http://127.0.0.1:{server.server_address[1]}").models()
    finally:
        server.shutdown()
    assert caught.value.status == 200 and "not an API answer" in str(caught.value)
