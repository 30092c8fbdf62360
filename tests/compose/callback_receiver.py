"""A callback receiver for the compose test, run in a container of the stack's own network: it keeps every POST
(headers and body) in memory and lists them at GET /received. Standard library only."""

from __future__ import annotations

import base64
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

received: list[dict] = []
lock = threading.Lock()


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        with lock:
            received.append(
                {"path": self.path, "headers": dict(self.headers.items()), "body": base64.b64encode(body).decode()}
            )
        self.send_response(204)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        with lock:
            payload = json.dumps(received).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the container's first process: a stop ends it
    ThreadingHTTPServer(("0.0.0.0", 8080), Receiver).serve_forever()
