"""A WSGI app of answers without body bytes, for the API's gunicorn worker (app.server) under test: the API itself
has no 204 or 304 route. `/204`, `/304`, `/empty` (200, `Content-Length: 0`, an empty iterable) and `/one` (200,
a small body: the next request on a kept-alive connection)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "")
    if path == "/204":
        start_response("204 No Content", [("X-Answer", "204")])
        return []
    if path == "/304":
        start_response("304 Not Modified", [("ETag", '"v1"'), ("X-Answer", "304")])
        return []
    if path == "/empty":
        start_response("200 OK", [("Content-Length", "0"), ("X-Answer", "empty")])
        return []
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "3"), ("X-Answer", "one")])
    return [b"one"]
