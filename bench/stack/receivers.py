"""Callback receivers for `bench hostile` and the tests: a tarpit that holds each connection it is sent (trickling
its answer, or never answering) and a prompt receiver; real HTTP servers on threads of this process, each counting
what it was sent and how long every visit lasted."""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TARPIT_MODES = ("trickle", "trickle-headers", "silent")


@dataclass
class Visit:
    """One connection a tarpit held: when it opened and closed (monotonic), and who closed it."""

    opened: float
    closed: float | None = None
    closed_by_client: bool = False
    sent: int = 0  # bytes of the answer sent

    @property
    def held_s(self) -> float:
        return (self.closed if self.closed is not None else time.monotonic()) - self.opened


@dataclass
class Gauge:
    """Connections open at once, over one or several tarpits, and the most there ever were."""

    now: int = 0
    peak: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def change(self, by: int) -> None:
        with self.lock:
            self.now += by
            self.peak = max(self.peak, self.now)


class Tarpit:
    """A receiver that holds whoever calls it, on 127.0.0.1, one thread per connection, until the caller hangs up
    or `stop()`:

    - trickle: reads the request, sends its status line and headers (a Content-Length far ahead), then one byte of
      body every `interval_s`;
    - trickle-headers: sends its status line, then one byte of a header every `interval_s`, never ending them;
    - silent: accepts, reads whatever comes (a TLS ClientHello too), never answers."""

    def __init__(self, mode: str = "trickle", interval_s: float = 1.0, gauge: Gauge | None = None) -> None:
        if mode not in TARPIT_MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(TARPIT_MODES)}")
        self.mode, self.interval_s = mode, interval_s
        self.gauge = gauge or Gauge()
        self.visits: list[Visit] = []
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self._accept, name=f"tarpit-{self.port}", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        visit = Visit(time.monotonic())
        self.visits.append(visit)
        self.gauge.change(+1)
        try:
            if self.mode != "silent":
                if not self._read_request(conn):
                    visit.closed_by_client = True
                    return
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\n"
                    if self.mode == "trickle-headers"
                    else b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1000000\r\n\r\n"
                )
            drip = b"X-Slow: " + b"a" * 1_000_000 if self.mode == "trickle-headers" else b"." * 1_000_000
            while not self._stopping.is_set():
                if _hung_up(conn, self.interval_s):
                    visit.closed_by_client = True
                    return
                if self.mode != "silent":
                    conn.sendall(drip[visit.sent : visit.sent + 1])
                    visit.sent += 1
        except OSError:
            visit.closed_by_client = True
        finally:
            visit.closed = time.monotonic()
            conn.close()
            self.gauge.change(-1)

    @staticmethod
    def _read_request(conn: socket.socket) -> bool:
        """The request's head and its Content-Length of body; False when the caller hung up first."""
        conn.settimeout(30)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            body += chunk
        conn.settimeout(None)
        return True


def _hung_up(conn: socket.socket, wait_s: float) -> bool:
    """Waits up to wait_s on the caller; True once it has closed its end (what it sends meanwhile is dropped:
    a silent tarpit reads a TLS ClientHello as it reads anything)."""
    readable, _, _ = select.select([conn], [], [], wait_s)
    return bool(readable) and not conn.recv(65536)


class Receiver:
    """A receiver that answers 200 (after `delay_s`: a receiver that takes its time) and notes when each job's
    callback arrived (time.time())."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.arrived: dict[str, float] = {}
        self.calls: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.calls.append({"body": body, "headers": dict(self.headers)})
                receiver.arrived.setdefault(self.headers.get("X-Imgserve-Job-Id", ""), time.time())
                time.sleep(delay_s)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
