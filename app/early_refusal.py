"""A long-poll of a key already at its bound, refused before Flask: the same 429 app.holds gives, at about half
the CPU.

Under one key's 4,000 long-polls at once, each refusal took 0.65 ms of an API process (a /healthz 0.53 ms):
4,000 arriving together took both processes ~1.3 s, and a /healthz probe that arrived with them waited behind
them (up to 2 s here). Refused here, in the WSGI call before Flask builds a request, a refusal costs the server's
own work and little more. Only what is certain is refused here: a valid key (the one app.auth would find) asking
`wait=` above 0 on a job read or a submission, while its long-polls are at their bound; anything else, and every
other refusal, goes to the app as before (the counters are app.holds', read without taking a place).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from app.holds import Holds
from app.metrics import REJECTS, REQUESTS
from contract.documents import PROBLEM_TYPE

# The two routes that hold: a job read and a submission, with `wait=S` in the query.
_WAITING_PATH = re.compile(r"^/v1/jobs(/[0-9a-f]{32})?$")
_WAIT = re.compile(r"(?:^|&)wait=([0-9.]+)(?:&|$)")


def refusing_early(
    wsgi_app: Callable[..., Iterable[bytes]], holds: Holds, api_keys: Iterable[Any]
) -> Callable[..., Iterable[bytes]]:
    """`wsgi_app`, with a key's long-polls past its bound answered 429 before it is called."""
    keys = {str(entry["sha256"]): str(entry["id"]) for entry in api_keys}

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        client = _waiting_client(environ, keys)
        if client is not None:
            mine = holds.waits.get(client)
            if mine is not None and len(mine) >= holds.max_waits_per_client:
                return _refuse(environ, start_response, client, len(mine), mine.first_end_in(), holds)
        return wsgi_app(environ, start_response)

    return wrapped


def _waiting_client(environ: dict[str, Any], keys: dict[str, str]) -> str | None:
    """The key of a long-poll request (a job read or a submission with wait= above 0), or None."""
    match = _WAIT.search(environ.get("QUERY_STRING", ""))
    if match is None or environ.get("REQUEST_METHOD") not in ("GET", "POST"):
        return None
    path = environ.get("PATH_INFO", "")
    route = _WAITING_PATH.match(path)
    if route is None or (environ["REQUEST_METHOD"] == "GET") != bool(route.group(1)):
        return None
    try:
        if float(match.group(1)) <= 0:
            return None
    except ValueError:
        return None
    scheme, _, key = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        return None
    digest = hashlib.sha256(key.strip().encode()).hexdigest()
    found = None
    for known, client in keys.items():  # every key compared, in constant time each (as app.auth)
        if hmac.compare_digest(digest, known):
            found = client
    return found


def _refuse(
    environ: dict[str, Any], start_response: Callable[..., Any], client: str, held: int, retry_s: int, holds: Holds
) -> Iterable[bytes]:
    detail = (
        f"your key holds {held} long-polls in this API process (api.max_waits_per_client: "
        f"{holds.max_waits_per_client}); poll again when one ends, or without wait"
    )
    body = json.dumps(
        {"type": "/problems/too-many-held", "title": "Too many requests", "status": 429, "detail": detail}
    ).encode()
    route = "/v1/jobs/<job_id>" if environ["REQUEST_METHOD"] == "GET" else "/v1/jobs"
    REJECTS.labels("too-many-held").inc()
    REQUESTS.labels(environ["REQUEST_METHOD"], route, "429").inc()
    start_response(
        "429 TOO MANY REQUESTS",
        [
            ("Content-Type", PROBLEM_TYPE),
            ("Content-Length", str(len(body))),
            ("Retry-After", str(retry_s)),
            ("Connection", "close"),
            ("X-Content-Type-Options", "nosniff"),
        ],
    )
    return [body]
