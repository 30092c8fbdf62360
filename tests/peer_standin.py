"""A stand-in for the peer in bench.load.peer's tests, where LitServe is not installed: one process answering GET
/health and a multipart POST /predict with the decode floor's work on its image (`python -m tests.peer_standin
PORT SIZE`)."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.meters.floor import prepare


class Handler(BaseHTTPRequestHandler):
    size = 320

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        boundary = self.headers.get_content_type() == "multipart/form-data" and self.headers.get_param("boundary")
        if self.path != "/predict" or not boundary:
            self._answer(400, {"error": "a multipart POST to /predict"})
            return
        part = body.split(b"--" + str(boundary).encode())[1]
        image = part.split(b"\r\n\r\n", 1)[1].rsplit(b"\r\n", 1)[0]
        prepare(image, self.size)
        self._answer(200, {"status": "succeeded"})

    def _answer(self, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  # the base class's name
        pass


if __name__ == "__main__":
    Handler.size = int(sys.argv[2])
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
