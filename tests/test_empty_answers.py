"""Issue 59: answers without body bytes (HEAD, OPTIONS, 204, 304) through the API's gunicorn worker (app.server).
Before, the worker flushed the head before gunicorn had built it: nothing was written. A keep-alive client waited
5 s (keepalive) for the connection to close, and one sending `Connection: close` got an empty connection. The
stock gevent worker answers both at once; so does this one now. Each answer is read off a raw socket: its status
line and headers within a second, and on a kept-alive connection the next request answered after it."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from tests.conftest import GunicornApi
from tests.support import REPO_ROOT, ManagedProcess, free_port, python_argv, wait_until

pytestmark = pytest.mark.integration

PROMPT_S = 1.0  # the bound on a head's arrival (before: 5 s on keep-alive, never with Connection: close)


def request_bytes(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def read_head(sock: socket.socket, deadline: float) -> tuple[str, dict[str, str], bytes]:
    """The status line, the headers (lower-case names) and what came after them, read before the deadline."""
    got = b""
    while b"\r\n\r\n" not in got:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {got!r}"
        got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return status, headers, rest


def read_to_close(sock: socket.socket, deadline: float) -> bytes:
    got = b""
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            return got
        got += chunk


def ask(port: int, method: str, path: str, *headers: str) -> tuple[str, dict[str, str], bytes, float]:
    """One request on a new keep-alive connection; then a GET /healthz-like second one on it must be answered
    too: the first answer's framing is right. Returns the first's status, headers, stray bytes and seconds."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(request_bytes(method, path, *headers))
        status, found, rest = read_head(sock, started + 10)
        took = time.monotonic() - started
        assert found.get("connection") == "keep-alive", found
        sock.sendall(request_bytes("GET", path_after(path)))
        again, _, _ = read_head(sock, time.monotonic() + 10)
        assert again.startswith("HTTP/1.1 200"), again
    return status, found, rest, took


def ask_closing(port: int, method: str, path: str, *headers: str) -> tuple[str, dict[str, str], bytes, float]:
    """One request with `Connection: close`: the whole answer, then the connection's end, read."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(request_bytes(method, path, "Connection: close", *headers))
        whole = read_to_close(sock, started + 10)
        took = time.monotonic() - started
    assert whole, f"{method} {path} with Connection: close: the connection closed empty"
    head, _, rest = whole.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    found = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return status, found, rest, took


def path_after(path: str) -> str:
    return "/one" if path.startswith(("/204", "/304", "/empty")) else "/healthz"


@pytest.mark.parametrize("path", ["/healthz", "/"])
def test_head_is_answered_at_once_kept_alive_and_closing(gunicorn_api: GunicornApi, path: str):
    """Monitors' HEAD checks: before, 5.0 s on keep-alive (the worker's keepalive), an empty connection with
    `Connection: close`."""
    status, headers, rest, took = ask(gunicorn_api.port, "HEAD", path)
    assert status == "HTTP/1.1 200 OK" and took < PROMPT_S, (status, took)
    assert headers["content-type"].startswith("application/json") and headers["x-content-type-options"] == "nosniff"
    assert int(headers["content-length"]) > 0 and rest == b""  # the GET's length, no body
    status, headers, rest, took = ask_closing(gunicorn_api.port, "HEAD", path)
    assert status == "HTTP/1.1 200 OK" and took < PROMPT_S and rest == b"", (status, took, rest)
    assert headers["connection"] == "close"


def test_options_is_answered_at_once_kept_alive_and_closing(gunicorn_api: GunicornApi):
    """CORS preflights and OPTIONS probes: Flask's answer (200, `Allow`, no body) was never written."""
    status, headers, rest, took = ask(gunicorn_api.port, "OPTIONS", "/healthz")
    assert status == "HTTP/1.1 200 OK" and took < PROMPT_S, (status, took)
    assert {"GET", "HEAD", "OPTIONS"} <= {m.strip() for m in headers["allow"].split(",")}
    assert headers["content-length"] == "0" and rest == b""
    status, headers, rest, took = ask_closing(gunicorn_api.port, "OPTIONS", "/v1/jobs")
    assert status == "HTTP/1.1 200 OK" and took < PROMPT_S, (status, took)
    assert "POST" in headers["allow"] and headers["connection"] == "close" and rest == b""


@pytest.fixture(scope="module")
def bare_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """tests.bare_answers under gunicorn with the API's worker class, gunicorn's defaults otherwise."""
    port = free_port()
    process = ManagedProcess(
        "bare-gunicorn",
        python_argv(
            "-m",
            "gunicorn",
            "-k",
            "app.server.ProblemGeventWorker",
            "-w",
            "1",
            "-b",
            f"127.0.0.1:{port}",
            "--keep-alive",
            "5",
            "tests.bare_answers:app",
        ),
        {**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        tmp_path_factory.mktemp("bare-gunicorn"),
    )
    wait_until(lambda: _answers(port) or not process.alive(), 60, what="the bare gunicorn to answer")
    assert process.alive(), process.log_tail()
    yield port
    process.stop()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(request_bytes("GET", "/one", "Connection: close"))
            return read_to_close(sock, time.monotonic() + 2).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


@pytest.mark.parametrize(
    "method, path, expected",
    [
        ("GET", "/204", "HTTP/1.1 204 No Content"),
        ("GET", "/304", "HTTP/1.1 304 Not Modified"),
        ("GET", "/empty", "HTTP/1.1 200 OK"),
        ("HEAD", "/one", "HTTP/1.1 200 OK"),
    ],
)
def test_answers_without_body_bytes_are_written_at_once_by_the_worker(bare_worker: int, method, path, expected):
    status, headers, rest, took = ask(bare_worker, method, path)
    assert status == expected and took < PROMPT_S and rest == b"", (status, took, rest)
    assert headers["x-answer"] == path.strip("/")
    status, headers, rest, took = ask_closing(bare_worker, method, path)
    assert status == expected and took < PROMPT_S and rest == b"", (status, took, rest)
    assert headers["connection"] == "close" and headers["x-answer"] == path.strip("/")


def test_a_script_name_header_from_localhost_is_ignored_by_the_api(gunicorn_api: GunicornApi):
    """gunicorn trusts SCRIPT_NAME from forwarded_allow_ips (127.0.0.1): one the path did not start with was a 500
    labelled "Bad Request". The API's gunicorn config takes no forwarded SCRIPT_NAME: the header is dropped."""
    for script_name in ("/nope", "/healthz"):
        status, headers, rest, _ = ask(gunicorn_api.port, "GET", "/healthz", f"SCRIPT_NAME: {script_name}")
        assert status == "HTTP/1.1 200 OK", (script_name, status, rest)


def test_a_script_name_the_path_does_not_start_with_is_a_400_problem_by_the_worker(bare_worker: int):
    """With gunicorn's defaults (forwarded SCRIPT_NAME trusted from 127.0.0.1), the worker answers it 400."""
    status, headers, rest, took = ask_closing(bare_worker, "GET", "/one", "SCRIPT_NAME: /nope")
    assert status == "HTTP/1.1 400 Bad Request", (status, rest)
    assert headers["content-type"] == "application/problem+json" and b"SCRIPT_NAME" in rest
