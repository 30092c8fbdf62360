"""A long-poll of a key already at its bound, refused before Flask: the same 429 app.holds gives, for less CPU.

Refused in the app, a flood of one key's long-polls costs about what as many /healthz calls do, and a probe that
arrives with them waits behind them (docs/benchmarks/2026-12-06-hostile-round-five.md). Refused here, in the WSGI call
before Flask builds a request, a refusal costs the server's own work and little more. Only what is certain is refused
here: a valid key (the one app.auth would find) asking `wait=` above 0 on a job read or a submission, while its
long-polls are at their bound; anything else, and every other refusal, goes to the app as before (the counters are
app.holds', read without taking a place).

The query is read as the app reads it (Werkzeug's decoding, the same `wait` model): `wait=1e0`, `wait=%31`,
`%77ait=1`, `wait=+1`, `wait=1_0` are long-polls to both (a pattern of digits would let them through to the full
path). A query the app would refuse (a name the route does not take, `wait` twice or out of range) goes to it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import werkzeug.urls  # noqa: F401  # registers the "werkzeug.url_quote" codec error handler the app's parse uses
from pydantic import ValidationError

from app.auth import key_id
from app.holds import Holds
from app.metrics import REQUESTS
from app.problems import problem_wsgi
from app.submission import submit_query
from contract.documents import wait_query_model
from contract.settings import Settings

# The two routes that hold: a job read and a submission, with `wait=S` in the query.
_WAITING_PATH = re.compile(r"^/v1/jobs(/[0-9a-f]{32})?$")


@dataclass(frozen=True)
class WaitingQueries:
    """What the app takes in the holding routes' queries (any other name is its 400, before a hold is counted),
    and the model it reads `wait` with (its bounds: the deployment's longest long-poll)."""

    read_names: frozenset[str]
    submit_names: frozenset[str]
    max_wait_s: float

    @classmethod
    def of(cls, settings: Settings) -> WaitingQueries:
        max_wait_s = settings.api.max_wait_s
        return cls(
            frozenset(wait_query_model(max_wait_s).model_fields),
            frozenset(submit_query(settings).model_fields),
            max_wait_s,
        )


def refusing_early(
    wsgi_app: Callable[..., Iterable[bytes]], holds: Holds, api_keys: Iterable[Any], queries: WaitingQueries
) -> Callable[..., Iterable[bytes]]:
    """`wsgi_app`, with a key's long-polls past its bound answered 429 before it is called: app.holds' refusal
    (`waits_refusal`), written as app.problems writes every refusal (`problem_wsgi`)."""
    keys = tuple(api_keys)

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        client = _waiting_client(environ, keys, queries)
        refused = holds.waits_refusal(client) if client is not None else None
        if refused is not None:
            route = "/v1/jobs/<job_id>" if environ["REQUEST_METHOD"] == "GET" else "/v1/jobs"
            REQUESTS.labels(environ["REQUEST_METHOD"], route, "429").inc()
            return problem_wsgi(refused, route, start_response)
        return wsgi_app(environ, start_response)

    return wrapped


def _waiting_client(environ: dict[str, Any], keys: tuple[Any, ...], queries: WaitingQueries) -> str | None:
    """The key of a long-poll request (a job read or a submission with wait= above 0), or None."""
    method, query = environ.get("REQUEST_METHOD"), environ.get("QUERY_STRING", "")
    if method not in ("GET", "POST") or ("wait" not in query and "%" not in query):  # no `wait`, encoded or not
        return None
    route = _WAITING_PATH.match(environ.get("PATH_INFO", ""))
    if route is None or (method == "GET") != bool(route.group(1)):
        return None
    wait_s = _wait_s(query, queries.read_names if method == "GET" else queries.submit_names, queries.max_wait_s)
    if wait_s is None or wait_s <= 0:
        return None
    return key_id(environ.get("HTTP_AUTHORIZATION", ""), keys)  # the key app.auth would find


def _wait_s(query: str, names: frozenset[str], max_wait_s: float) -> float | None:
    """`wait` as the app reads it (Werkzeug's request.args, then app.submission.wait_seconds' model); None where
    the app answers something else first (a name it does not take, `wait` twice, a value it refuses) or none."""
    try:
        pairs = parse_qsl(query.encode("latin1").decode(), keep_blank_values=True, errors="werkzeug.url_quote")
    except UnicodeError:
        return None
    waits = [value for name, value in pairs if name == "wait"]
    if len(waits) != 1 or any(name not in names for name, _ in pairs):
        return None
    try:
        return wait_query_model(max_wait_s).model_validate({"wait": waits[0]}).wait
    except ValidationError:
        return None
