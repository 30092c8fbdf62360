"""The API's gunicorn worker (app.server): what it changes in a gevent-patched process."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO_ROOT

_READINESS = """
from gevent import monkey
monkey.patch_all()
import socket, time, gevent
from redis._parsers import hiredis as parser
from app.server import cheap_readiness_checks
cheap_readiness_checks()
a, b = socket.socketpair()
assert parser._socket_can_read(a, 0) is False            # idle: no stale reply
b.sendall(b"+OK\\r\\n")
assert parser._socket_can_read(a, 0) is True             # a reply waits
a.recv(16)
ticks = []
ticker = gevent.spawn(lambda: [ticks.append(gevent.sleep(0.01)) for _ in range(5)])
started = time.monotonic()
assert parser._socket_can_read(a, 0.2) is False           # a real wait still goes through gevent's poll...
assert time.monotonic() - started >= 0.15
assert len(ticks) >= 3, ticks                             # ...and lets other greenlets run meanwhile
print("ok")
"""


def test_zero_timeout_readiness_checks_skip_gevents_hub_and_real_waits_do_not():
    """redis-py's check before each command polls with a zero timeout: done without gevent's hub (it cannot
    block); a wait with a timeout (the long-polls' pub/sub listener) still yields to other greenlets."""
    result = subprocess.run(
        [sys.executable, "-c", _READINESS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


class _RecordingSocket:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))


def _response(method: str = "GET"):
    from types import SimpleNamespace

    from gunicorn.config import Config

    from app.server import OneWriteResponse

    request = SimpleNamespace(version=(1, 1), method=method, should_close=lambda: False)
    sock = _RecordingSocket()
    return OneWriteResponse(request, sock, Config()), sock


def test_a_small_answer_leaves_in_one_write_head_and_body():
    """gunicorn wrote the head and the body in two sends: on loopback each send is most of a small answer's cost."""
    response, sock = _response()
    response.start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", "11")])
    response.write(b'{"ok": true}'[:11])
    response.close()
    assert len(sock.sent) == 1
    head, _, body = sock.sent[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 11" in head and body == b'{"ok": true'


def test_a_bodiless_a_large_and_a_chunked_answer_still_send_their_head_first():
    head_only, sock = _response("HEAD")
    head_only.start_response("200 OK", [("Content-Length", "11")])
    head_only.write(b"")
    head_only.close()
    assert len(sock.sent) == 1 and sock.sent[0].endswith(b"\r\n\r\n")  # HEAD: the head, no body

    large, sock = _response()
    body = b"x" * (200 * 1024)
    large.start_response("200 OK", [("Content-Length", str(len(body)))])
    large.write(body)
    large.close()
    assert sock.sent[0].endswith(b"\r\n\r\n") and b"".join(sock.sent[1:]) == body  # not copied behind the head

    chunked, sock = _response()
    chunked.start_response("200 OK", [("Content-Type", "text/plain")])  # no length: chunked framing
    chunked.write(b"abc")
    chunked.close()
    assert sock.sent[0].endswith(b"\r\n\r\n") and b"Transfer-Encoding: chunked" in sock.sent[0]
    assert b"".join(sock.sent[1:]) == b"3\r\nabc\r\n0\r\n\r\n"
