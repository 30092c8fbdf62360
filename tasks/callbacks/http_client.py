"""The callbacks' HTTP client: one POST to the address that passed the URL check (contract.callbacks), bounded
by the attempt's deadline whatever the receiver does (connect, TLS, each write and read, the name lookup).
No redirect is followed, no proxy is used. What is posted and when is tasks.callbacks.delivery'; how it is signed,
contract.callbacks.callback_signature's.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import certifi

from contract.callbacks import CallbackTarget

USER_AGENT = "imgserve-callbacks"


class DeliveryFailed(RuntimeError):
    """The receiver did not answer 2xx (or could not be reached, or not within the attempt's deadline)."""


class Deadline:
    """An attempt's end: each wait within it (connect, TLS, a write, a read) is given what is left, at most
    `step_s`: a per-read timeout alone lets a receiver sending a byte now and then hold a thread for as long as it
    cares to."""

    def __init__(self, seconds: float, step_s: float | None = None) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.step_s = seconds if step_s is None else step_s

    def left(self) -> float:
        """What is left for the next wait; TimeoutError once nothing is."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the attempt's deadline of {self.seconds:g} s passed")
        return min(left, self.step_s)


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes for http.client's response parser, each read bounded by the deadline: the status line,
    the headers (however slowly trickled) and the body all come within it, or the attempt ends."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.sock.settimeout(self.deadline.left())
        return self.sock.recv_into(buffer)


class _DeadlineSocket:
    """What http.client.HTTPResponse reads from: makefile() only."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self.sock, self.deadline))


_tls_context: ssl.SSLContext | None = None
_tls_lock = threading.Lock()


def tls_context() -> ssl.SSLContext:
    """One verifying context per process (certifi's roots): loading them parses every root, too slow for each
    attempt, and a context is shared safely between threads."""
    global _tls_context
    with _tls_lock:
        if _tls_context is None:
            _tls_context = ssl.create_default_context(cafile=certifi.where())
        return _tls_context


def post_within(
    target: CallbackTarget, body: bytes, headers: Mapping[str, str], deadline: Deadline, max_response_bytes: int
) -> int:
    """POST to the checked address itself; the URL's host goes in Host (and SNI and the certificate check for
    https). Returns the status; reads at most max_response_bytes of the answer. The whole attempt (connect, TLS
    handshake, the request, the answer's status line, headers and body) ends within `deadline` whatever the
    receiver does: DeliveryFailed otherwise."""
    url = target.url
    family = socket.AF_INET6 if ":" in target.address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(deadline.left())
        sock.connect((target.address, url.port))
        if url.scheme == "https":
            sock.settimeout(deadline.left())  # the handshake is one call: bounded by the timeout as it starts
            sock = tls_context().wrap_socket(sock, server_hostname=url.host)
        lines = [
            f"POST {url.target} HTTP/1.1",
            f"Host: {url.host_header}",
            f"User-Agent: {USER_AGENT}",
            "Accept-Encoding: identity",
            "Connection: close",
            f"Content-Length: {len(body)}",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        _send_all(sock, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body, deadline)
        response = http.client.HTTPResponse(_DeadlineSocket(sock, deadline), method="POST")  # type: ignore[arg-type]
        response.begin()
        response.read(max_response_bytes)
        return response.status
    except TimeoutError as exc:
        raise DeliveryFailed(f"the receiver did not answer within {deadline.seconds:g} s ({exc})") from exc
    except ssl.SSLError as exc:
        raise DeliveryFailed(f"TLS with the receiver failed: {exc.reason or type(exc).__name__}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise DeliveryFailed(f"cannot reach the receiver: {type(exc).__name__}: {exc}"[:200]) from exc
    finally:
        sock.close()


def _send_all(sock: socket.socket, data: bytes, deadline: Deadline) -> None:
    """sendall, each send bounded by what is left (an SSL socket's sendall gives each of its sends the whole
    timeout: a receiver reading slowly would stretch it)."""
    view = memoryview(data)
    while view:
        sock.settimeout(deadline.left())
        view = view[sock.send(view) :]


def bounded_resolver(deadline: Deadline) -> Callable[..., list[Any]]:
    """getaddrinfo within the deadline. The lookup cannot be interrupted, so it runs in a helper thread that is
    left to the resolver's own timeout when the deadline passes (an attacker's name server that never answers
    would otherwise hold the callback thread for the resolver's timeouts and retries)."""

    def resolve(host: str, port: int, **kwargs: Any) -> list[Any]:
        try:
            ipaddress.ip_address(host)
            return socket.getaddrinfo(host, port, **kwargs)  # a literal address: no lookup, nothing to wait for
        except ValueError:
            pass
        outcome: dict[str, Any] = {}

        def lookup() -> None:
            try:
                outcome["infos"] = socket.getaddrinfo(host, port, **kwargs)
            except Exception as exc:
                outcome["error"] = exc

        helper = threading.Thread(target=lookup, name="callback-lookup", daemon=True)
        helper.start()
        helper.join(max(0.0, deadline.at - time.monotonic()))
        if helper.is_alive():
            raise DeliveryFailed(f"the receiver's host did not resolve within {deadline.seconds:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return list(outcome["infos"])

    return resolve
