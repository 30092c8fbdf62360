"""The gunicorn worker the API runs on: gevent, with gunicorn's own error answers in the API's form.

gunicorn answers some requests itself, before the app sees them (a malformed
request line, a URI or headers over the limits, broken framing): as HTML.
This worker writes those as problem+json too, so every error a client can get
from the service has one shape.
"""
from __future__ import annotations

import json
import socket

from gunicorn import util
from gunicorn.workers.ggevent import GeventWorker


def write_problem(sock: socket.socket, status: int, reason: str, message: str) -> None:
    """What gunicorn.util.write_error writes, as application/problem+json."""
    slug = reason.lower().replace(" ", "-")
    body = json.dumps({"type": f"/problems/{slug}", "title": reason, "status": status,
                       "detail": message or reason}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/problem+json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
    util.write_nonblock(sock, head + body)


class ProblemGeventWorker(GeventWorker):
    def init_process(self) -> None:
        util.write_error = write_problem   # in this worker process only; the master keeps gunicorn's
        super().init_process()
