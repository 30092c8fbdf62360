"""The client and the CLI against a hostile server on 127.0.0.1: an answer of hundreds of MB, one that trickles a
byte at a time, and text that would command the terminal. Each ends, bounded, with a clear error."""

from __future__ import annotations

import json
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from imgserve_client import AnswerTooLarge, AnswerTooSlow, ApiError, Client, printable
from tests.support import wait_until

HUGE = 300 * 1024 * 1024
ESC = "\x1b"
TITLE_SEQUENCE = f"{ESC}]0;owned{chr(7)}"  # would set the terminal's title
CLEAR_SEQUENCE = f"{ESC}[2J"  # would clear the screen


class HostileServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), HostileHandler)
        self.sent: dict[str, int] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class HostileHandler(socketserver.StreamRequestHandler):
    server: HostileServer

    def handle(self) -> None:
        line = self.rfile.readline().decode("latin-1")
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        path = line.split()[1].partition("?")[0]
        try:
            if path.endswith("/huge"):
                self._huge(path, declared=True)
            elif path.endswith("/endless"):
                self._huge(path, declared=False)
            elif path.endswith("/trickle"):
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
                for _ in range(1000):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            elif path.endswith("/escapes"):
                self._json(
                    404,
                    {"title": f"Not found{TITLE_SEQUENCE}", "detail": f"gone{CLEAR_SEQUENCE}", "status": 404},
                    "application/problem+json",
                )
            else:
                self._json(202, {"id": f"abc{CLEAR_SEQUENCE}", "status": "queued"}, "application/json")
        except OSError:  # the client hung up: what it was meant to do
            pass

    def _huge(self, path: str, declared: bool) -> None:
        length = f"Content-Length: {HUGE}\r\n" if declared else "Connection: close\r\n"
        self.wfile.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n".encode())
        chunk, sent = b"0" * 65536, 0
        try:
            while sent < HUGE:
                self.wfile.write(chunk)
                sent += len(chunk)
        finally:
            self.server.sent[path] = sent

    def _json(self, status: int, body: dict, media_type: str) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        head = f"HTTP/1.1 {status} X\r\nContent-Type: {media_type}\r\nContent-Length: {len(data)}\r\n\r\n"
        self.wfile.write(head.encode() + data)


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    server = HostileServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_an_answer_past_the_bound_is_refused_whether_declared_or_not(hostile: HostileServer):
    client = Client(hostile.url, max_answer_bytes=1024 * 1024, retries=0)
    with pytest.raises(AnswerTooLarge, match="bytes"):
        client.status("huge")
    with pytest.raises(AnswerTooLarge, match="more than 1,048,576 bytes"):
        client.status("endless")
    # The undeclared one was read up to the bound, not to its end (what the socket buffers hold past it aside):
    # the server's writer says how far it got once the closed connection stops it.
    wait_until(lambda: "/v1/jobs/endless" in hostile.sent, 30, what="the server's writer to stop")
    assert hostile.sent["/v1/jobs/endless"] < HUGE


def test_an_answer_that_trickles_ends_at_the_calls_deadline(hostile: HostileServer):
    client = Client(hostile.url, timeout_s=1.5, retries=0)
    with pytest.raises(AnswerTooSlow, match="within 1.5 s"):
        client.status("trickle")  # a byte every 0.2 s: each read in time, the whole never


def test_what_the_server_writes_reaches_the_terminal_escaped():
    assert printable(f"a{ESC}[2Jb\u202ec") == "a\\x1b[2Jb\\u202ec"  # bidi override too
    error = ApiError(404, {"title": f"x{TITLE_SEQUENCE}", "detail": "y"})
    assert ESC not in str(error) and "\\x1b]0;owned\\x07" in str(error)


def cli(hostile: HostileServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "imgserve_client.cli", "--url", hostile.url, "--retries", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_ends_a_huge_answer_and_escapes_the_servers_text(hostile: HostileServer):
    huge = cli(hostile, "status", "huge")
    assert huge.returncode == 1 and "answer of 314,572,800 bytes" in huge.stderr, huge.stderr
    refused = cli(hostile, "status", "escapes")
    assert refused.returncode == 1
    assert ESC not in refused.stderr and "\\x1b" in refused.stderr, refused.stderr
    submitted = cli(hostile, "submit", "samples/shapes-36.jpg")
    assert submitted.returncode == 0 and ESC not in submitted.stdout and "abc\\x1b[2J" in submitted.stdout
