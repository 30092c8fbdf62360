"""The gunicorn worker the API runs on: gevent, with gunicorn's own error answers in the API's form.

gunicorn answers some requests itself, before the app sees them (a malformed
request line, a URI or headers over the limits, broken framing): as HTML.
This worker writes those as problem+json too, so every error a client can get
from the service has one shape. And a request refused before its body was
read (401, 413) closes its connection and says so: otherwise gunicorn would
answer `keep-alive` and then read the whole refused body to find the next request.
"""

from __future__ import annotations

import json
import logging
import socket
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from gunicorn import glogging, util
from gunicorn.http import wsgi
from gunicorn.http.errors import ConfigurationProblem, InvalidHeader
from gunicorn.workers.ggevent import GeventWorker

from contract.documents import PROBLEM_TYPE
from contract.runtime.logs import QUIET_LOGGERS, JsonFormatter
from contract.settings.config import load_settings

_REFUSED_UNREAD = ("401", "408", "413")
_MAY_CLOSE = ("429", "503")  # app.holds' refusals say Connection: close (only these are looked at: cheaper)


def write_problem(sock: socket.socket, status: int, reason: str, message: str) -> None:
    """What gunicorn.util.write_error writes, as application/problem+json."""
    slug = reason.lower().replace(" ", "-")
    body = json.dumps(
        {"type": f"/problems/{slug}", "title": reason, "status": status, "detail": message or reason}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: {PROBLEM_TYPE}\r\n"
        f"X-Content-Type-Options: nosniff\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode("latin-1")
    util.write_nonblock(sock, head + body)


def close_after_refusal(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """WSGI middleware: a 401, 408 or 413 to a request that carries a body ends the connection, and so does any
    answer whose headers say `Connection: close` (gunicorn drops that header from an app: a hop-by-hop one).
    app.holds' refusals say so: a client held at its bound keeps no idle connection either."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        carries_body = (
            environ.get("CONTENT_LENGTH") not in (None, "", "0")
            or "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        )

        def refusing_start_response(status: str, headers: list, exc_info: Any = None) -> Any:
            response = getattr(start_response, "__self__", None)  # gunicorn's Response
            code = status[:3]
            closing = code in _MAY_CLOSE and any(
                name.lower() == "connection" and value.lower() == "close" for name, value in headers
            )
            if response is not None and (closing or (carries_body and code in _REFUSED_UNREAD)):
                response.must_close = True
            return start_response(status, headers, exc_info)

        return app(environ, refusing_start_response)

    return wrapped


def cheap_readiness_checks() -> None:
    """redis-py polls a pooled connection with a zero timeout before every command (is a stale reply waiting?);
    gevent's patched poll does that with a Timeout and two switches to its hub, half again the CPU of the
    command itself. A zero-timeout poll never blocks, so the unpatched poll does it here; any other timeout
    (the pub/sub listener's wait) still goes through gevent's."""
    import select

    from gevent.monkey import get_original
    from redis._parsers import hiredis as parser

    unpatched_poll = get_original("select", "poll")
    through_gevent = parser._socket_can_read

    def socket_can_read(sock: Any, timeout: float | None) -> bool:
        if timeout != 0 or hasattr(sock, "pending"):  # TLS keeps bytes above the socket: redis-py's own check
            return bool(through_gevent(sock, timeout))  # type: ignore[arg-type]  # redis-py passes None to block
        poller = unpatched_poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))

    parser._socket_can_read = socket_can_read


class OneWriteResponse(wsgi.Response):  # type: ignore[misc]  # gunicorn is untyped
    """gunicorn's HTTP/1 response, its head sent in the same write as the body's first bytes. gunicorn writes
    the head, then the body, in two sends: on loopback each send is most of a small answer's cost
    (docs/benchmarks/2026-12-05-peer.md), and every answer here is a small JSON document. A body
    over COALESCE_MAX_BYTES, a chunked one, or none at all (HEAD, OPTIONS, 204, 304) gets the head on its own,
    first; an answer without body bytes gets it when the response closes."""

    _head = b""

    def send_headers(self) -> None:
        if self.headers_sent:  # type: ignore[has-type]  # gunicorn's untyped attribute
            return
        tosend = self.default_headers()
        tosend.extend([f"{name}: {value}\r\n" for name, value in self.headers])
        self._head = util.to_bytestring("{}\r\n".format("".join(tosend)), "latin-1")
        self.headers_sent = True  # as gunicorn means it: decided, and going out with the body
        if self.chunked:
            self._flush_head()

    def _emit_body(self, data: bytes) -> None:
        if self._head and len(data) <= COALESCE_MAX_BYTES:
            data, self._head = self._head + data, b""
        self._flush_head()
        super()._emit_body(data)

    def close(self) -> None:
        # A response that wrote no body bytes (HEAD, OPTIONS, 204, 304, an empty body): the app's iterable was
        # empty, write() never ran, and the head is decided only here. Flushing before gunicorn's own close built
        # it sent nothing (a keep-alive client waited for a head, a closing one got an empty connection).
        self.send_headers()
        self._flush_head()
        super().close()

    def sendfile(self, respiter: Any) -> bool:
        """No sendfile: gunicorn's would put the file's bytes on the socket behind a head not yet written. The API
        serves no files; one would go through write(), in blocks, its head first."""
        return False

    def _flush_head(self) -> None:
        if self._head:
            head, self._head = self._head, b""
            util.write(self.sock, head)


COALESCE_MAX_BYTES = 64 * 1024


class ProblemGeventWorker(GeventWorker):
    def patch(self) -> None:
        # gevent warns that ssl was imported before its patch ("may lead to errors, including RecursionError on
        # Python 3.6"): gunicorn's own config module imports it in the master, and nothing made an SSL context
        # before the fork; the RecursionError was Python 3.6's. Two such warnings began every start.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Monkey-patching ssl after ssl has already been imported")
            super().patch()
        cheap_readiness_checks()

    def init_process(self) -> None:
        util.write_error = write_problem  # in this worker process only; the master keeps gunicorn's
        wsgi.Response = OneWriteResponse  # gunicorn.http.wsgi.create builds this worker's HTTP/1 responses
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = close_after_refusal(self.wsgi)  # type: ignore[has-type]  # gunicorn's untyped attribute

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        """A `SCRIPT_NAME` header that the request's path does not start with is the client's error: gunicorn
        answers it 500 "Bad Request" (a ConfigurationProblem). configs/gunicorn.conf.py trusts no forwarded
        SCRIPT_NAME at all (the header is dropped); with forwarder_headers set back, this keeps it a 400."""
        if isinstance(exc, ConfigurationProblem):
            exc = InvalidHeader("SCRIPT_NAME")
        super().handle_error(req, client, addr, exc)


class JsonLogger(glogging.Logger):  # type: ignore[misc]  # gunicorn is untyped
    """gunicorn's own lines ("Booting worker", "Worker exiting", its errors) as the API's JSON lines, and only its
    warnings and errors unless logs.verbose: it printed five plain-text lines at each start. The access log
    (api.access_log) keeps gunicorn's format."""

    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        logs = load_settings().logs
        if logs.format == "json":
            for handler in self.error_log.handlers:
                handler.setFormatter(JsonFormatter("api"))
        if not logs.verbose and self.error_log.level < QUIET_LOGGERS["gunicorn.error"]:
            self.error_log.setLevel(QUIET_LOGGERS["gunicorn.error"])
        logging.getLogger("gunicorn.error").propagate = False
