"""Answers read as from a stranger: a bound on their size, a deadline on the whole exchange, and text made safe to
print.

A per-read timeout (what `requests` offers) never ends an answer that trickles a byte at a time, and a body read
whole may be any size. Here every request's socket is known by the thread that sent it, so a deadline can shut
it down whatever the read is waiting for, and the body is read in pieces up to a bound.
"""

from __future__ import annotations

import socket
import threading
import time
import unicodedata
from typing import Any

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

MAX_ANSWER_BYTES = 16 * 1024 * 1024  # far past any answer the API gives (its largest, a result at max_det, is KBs)
_CHUNK = 64 * 1024


class AnswerTooLarge(requests.RequestException):
    """The answer was longer than the client reads."""


class AnswerTooSlow(requests.Timeout):
    """The whole answer did not arrive within the call's deadline."""


class _InFlight:
    """The connection each thread is using now: a deadline that passes shuts that connection's socket down."""

    def __init__(self) -> None:
        self._by_thread: dict[int, urllib3.connection.HTTPConnection] = {}
        self._lock = threading.Lock()

    def using(self, connection: urllib3.connection.HTTPConnection) -> None:
        with self._lock:
            self._by_thread[threading.get_ident()] = connection

    def done(self, thread: int) -> None:
        with self._lock:
            self._by_thread.pop(thread, None)

    def cut(self, thread: int) -> None:
        with self._lock:
            connection = self._by_thread.pop(thread, None)
        sock = getattr(connection, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the read that waits on it, in the other thread
            except OSError:
                pass


IN_FLIGHT = _InFlight()


class _WatchedHTTPConnection(urllib3.connection.HTTPConnection):
    def request(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        IN_FLIGHT.using(self)
        super().request(*args, **kwargs)


class _WatchedHTTPSConnection(urllib3.connection.HTTPSConnection):
    def request(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        IN_FLIGHT.using(self)
        super().request(*args, **kwargs)


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


class WatchedAdapter(HTTPAdapter):
    """An adapter whose connections say which thread uses them, so that `bounded` can cut one at its deadline.
    (Through a proxy, requests makes its own pools: the deadline is then the per-read timeout's.)"""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}


def bounded(
    session: requests.Session, method: str, url: str, deadline_s: float, max_bytes: int, **kwargs: Any
) -> requests.Response:
    """One request whose whole exchange (connect, headers, body) ends within `deadline_s` and whose body is at most
    `max_bytes`: AnswerTooSlow or AnswerTooLarge otherwise. The body is read here, so `.json()` and `.text` work."""
    thread, started = threading.get_ident(), time.monotonic()
    timer = threading.Timer(deadline_s, IN_FLIGHT.cut, args=(thread,))
    timer.daemon = True
    timer.start()
    try:
        try:
            response = session.request(method, url, stream=True, **kwargs)
            try:
                response._content = _read_body(response, max_bytes)
            finally:
                response.close()
        except AnswerTooLarge:
            raise
        except (requests.RequestException, OSError) as exc:
            if time.monotonic() - started >= deadline_s:
                raise AnswerTooSlow(f"no whole answer from {url} within {deadline_s:g} s") from exc
            raise
        return response
    finally:
        timer.cancel()
        IN_FLIGHT.done(thread)


def _read_body(response: requests.Response, max_bytes: int) -> bytes:
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise AnswerTooLarge(f"an answer of {int(declared):,} bytes (this client reads at most {max_bytes:,})")
    body = bytearray()
    for chunk in response.iter_content(_CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise AnswerTooLarge(f"an answer of more than {max_bytes:,} bytes (this client reads at most that)")
    return bytes(body)


def printable(text: object) -> str:
    """`text` with every control and format character written as an escape: what a server sent reaches a
    terminal as text, never as a command to it (colours, cursor moves, a title, a hidden line, bidi reordering)."""
    out = []
    for char in str(text):
        if unicodedata.category(char)[0] == "C":
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)
