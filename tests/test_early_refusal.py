"""Issue 59: the early refusal (app.early_refusal) read `wait` with a pattern of digits, the app with Werkzeug's
decoding and a model: `wait=1e0`, `wait=%31`, `%77ait=1`, `wait=+1`, `wait=1_0`, `wait=%201` were long-polls to the
app and not to the early check, so a key at its bound got them to the full path (0.65 ms a refusal instead of
0.45; the bound held). Each query here goes to both, with a key at its bound: refused early exactly when the app
itself answers 429 too-many-held, and with the same wait where both read one."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import flask
import pytest
from werkzeug.test import EnvironBuilder, run_wsgi_app

from app import create_app
from app.auth import hash_key
from app.early_refusal import WaitingQueries, _wait_s, refusing_early
from app.services import services
from contract.settings.config import load_settings
from tests.support import free_port

KEY = "attacker-key-0123456789"
JOB = "0123456789abcdef" * 2
ISSUE = ["wait=1e0", "wait=%31", "%77ait=1", "wait=+1", "wait=1_0", "wait=%201"]
OTHERS = [
    "wait=30",
    "wait=2.5",
    "wait=.5",
    "wait=1.",
    "wait=1%20",
    "%77%61%69%74=3",
    "wait=1e1",
    "wait=1e3",  # over api.max_wait_s: the app's 400
    "wait=31",
    "wait=0",
    "wait=-0",
    "wait=-1",
    "wait=",
    "wait",
    "wait=abc",
    "wait=inf",
    "wait=nan",
    "wait=0x1",
    "wait=%D9%A1",  # an Arabic-Indic one
    "wait=%ff",
    "wait=1%00",
    "wait=1&wait=2",  # twice: the app's 400
    "wait=1&bogus=2",  # a name the route does not take: the app's 400
    "WAIT=1",
    "w+ait=1",
    "wait=1;x=2",
    "",
]


@pytest.fixture(scope="module")
def app() -> Iterator[flask.Flask]:
    """The app with one key, its long-polls at their bound (2 here); nothing of what is asked needs Redis."""
    settings = load_settings()
    settings = dataclasses.replace(
        settings,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        api=dataclasses.replace(settings.api, max_waits_per_client=2),
        redis=dataclasses.replace(settings.redis, timeout_s=0.5),
        auth=dataclasses.replace(settings.auth, api_keys=({"id": "attacker", "sha256": hash_key(KEY)},)),
    )
    app = create_app(settings)
    holds = services(app).holds
    held = [holds.wait("attacker", 30.0), holds.wait("attacker", 30.0)]
    for wait in held:
        wait.__enter__()
    yield app
    for wait in held:
        wait.__exit__(None, None, None)


def verdicts(app: flask.Flask, method: str, path: str, query: str) -> tuple[bool, str]:
    """(refused by the early check, what the app alone answers: its status and problem type)."""
    environ = EnvironBuilder(path=path, method=method, headers={"Authorization": f"Bearer {KEY}"}).get_environ()
    environ["QUERY_STRING"] = query
    reached = []

    def inner(environ: dict, start_response) -> list[bytes]:
        reached.append(1)
        start_response("204 No Content", [])
        return []

    settings = services(app).settings
    early = refusing_early(inner, services(app).holds, settings.auth.api_keys, WaitingQueries.of(settings))
    run_wsgi_app(early, dict(environ))
    body, status, _ = run_wsgi_app(lambda e, s: flask.Flask.wsgi_app(app, e, s), dict(environ))
    text = b"".join(body)
    kind = json.loads(text)["type"] if text.startswith(b"{") else ""
    return not reached, f"{status[:3]} {kind}"


@pytest.mark.parametrize("query", ISSUE + OTHERS)
@pytest.mark.parametrize("method, path", [("GET", f"/v1/jobs/{JOB}"), ("POST", "/v1/jobs")])
def test_the_early_check_refuses_exactly_the_long_polls_the_app_refuses_for_the_bound(app, method, path, query):
    early, full = verdicts(app, method, path, query)
    assert early == (full == "429 /problems/too-many-held"), (query, early, full)
    if query in ISSUE:
        assert early, f"{query}: a long-poll to the app, let through by the early check"


@pytest.mark.parametrize("query", ISSUE)
def test_the_issues_values_are_read_as_the_app_reads_them(app, query):
    settings = services(app).settings
    queries = WaitingQueries.of(settings)
    with app.test_request_context(f"/v1/jobs/{JOB}", environ_overrides={"QUERY_STRING": query}):
        from app.submission import wait_seconds

        assert _wait_s(query, queries.read_names, queries.max_wait_s) == wait_seconds(settings.api.max_wait_s) > 0


def test_the_refusal_before_flask_is_the_apps_own_429_and_finds_keys_as_app_auth_does():
    """One home for the 429 (issue 63, item 4): the document and headers are app.problems' for app.holds' own
    refusal, and the key is app.auth's lookup: with two entries for one key (a configuration mistake), both
    pick the first, as app.auth always did."""
    from app.auth import hash_key, key_id
    from app.holds import Holds
    from app.problems import problem_wsgi

    holds = Holds(
        max_requests_per_client=10,
        max_waits_per_client=1,
        max_waits=10,
        max_body_bytes=1 << 20,
        max_body_bytes_per_client=1 << 20,
    )
    assert holds.waits_refusal("a") is None
    with holds.wait("a", 30):
        refused = holds.waits_refusal("a")
        assert refused is not None and refused.status == 429 and refused.slug == "too-many-held"
        answered: list = []
        body = problem_wsgi(
            refused, "/v1/jobs/<job_id>", lambda status, headers: answered.extend([status, dict(headers)])
        )
    status, headers = answered
    document = json.loads(b"".join(body))
    assert status == "429 TOO MANY REQUESTS" and headers["Content-Type"] == "application/problem+json"
    assert (
        headers["Retry-After"] and headers["Connection"] == "close" and headers["X-Content-Type-Options"] == "nosniff"
    )
    assert (
        document["type"] == "/problems/too-many-held"
        and document["status"] == 429
        and "1 long-polls" in document["detail"]
    )
    twice = ({"id": "first", "sha256": hash_key("k")}, {"id": "second", "sha256": hash_key("k")})
    assert (
        key_id("Bearer k", twice) == "first" and key_id("Basic k", twice) is None and key_id("Bearer x", twice) is None
    )
