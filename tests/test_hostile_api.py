"""Hostile clients, round four, against the API: metrics labels that anyone could multiply, an expensive page
anyone could ask for, answers that told too much or too little. Each attack, and what it gets now."""

from __future__ import annotations

import random
import string

import pytest
import requests

from app import create_app, openapi
from app.multipart import MAX_PARTS
from contract.callbacks import REFUSED_HOST
from tests.support import ApiServer, jpeg

pytestmark = pytest.mark.integration


def series(text: str) -> set[str]:
    """The samples of a Prometheus text exposition: one per series."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def random_token(rng: random.Random, size: int) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(size))


def test_random_methods_and_paths_add_no_metrics_series(gunicorn_api):
    """3,000 random methods on /healthz, without a key, made 3,435 series and a scrape ten times slower. Methods
    and paths outside the API's own now count as `other`: one series however many there are."""
    rng = random.Random(4)
    session = requests.Session()
    session.request("XWARMUP", gunicorn_api.url + "/healthz", timeout=10)  # `other`'s own series, once
    session.get(gunicorn_api.url + "/no-such-path", timeout=10)
    session.get(gunicorn_api.url + "/metrics", timeout=10)  # and the scrape's own
    before = series(session.get(gunicorn_api.url + "/metrics", timeout=10).text)
    statuses = set()
    for i in range(1000):
        path = "/healthz" if i % 2 else f"/{random_token(rng, 12).lower()}"
        statuses.add(session.request("X" + random_token(rng, 9), gunicorn_api.url + path, timeout=10).status_code)
    after = series(session.get(gunicorn_api.url + "/metrics", timeout=10).text)
    assert statuses <= {404, 405}, statuses  # the attack reached the app: each was answered there
    new = after - before
    assert len(new) < 10, sorted(new)[:20]
    assert any('method="other"' in line for line in after)


def test_the_docs_page_and_the_document_are_built_once_and_served_as_they_were(stack, monkeypatch):
    """/docs cost 45 ms of CPU a call, rendered each time for anyone without a key; now both renderings are made
    once per app (its settings) and served as the same bytes (docs/security.md has the figures)."""
    builds, renders = [], []
    build, render = openapi.build_document, openapi.render_template_string
    monkeypatch.setattr(openapi, "build_document", lambda app: builds.append(app) or build(app))
    monkeypatch.setattr(
        openapi, "render_template_string", lambda *args, **kwargs: renders.append(1) or render(*args, **kwargs)
    )
    server = ApiServer(create_app(stack.settings))
    try:
        pages = [requests.get(server.url + "/docs", timeout=10) for _ in range(3)]
        documents = [requests.get(server.url + "/openapi.json", timeout=10) for _ in range(3)]
        first = server.app.extensions["imgserve.openapi"]
        again = requests.get(server.url + "/docs", timeout=10)
        assert server.app.extensions["imgserve.openapi"] is first
    finally:
        server.stop()
    assert len(builds) == 1 and len(renders) == 1
    assert all(page.status_code == 200 and page.content == first.html for page in [*pages, again])
    assert pages[0].headers["Content-Type"].startswith("text/html")
    assert "Content-Security-Policy" in pages[0].headers  # the page's guard headers are kept
    assert all(doc.status_code == 200 and doc.content == first.json for doc in documents)
    assert documents[0].headers["Content-Type"] == "application/json"
    assert documents[0].json()["paths"]["/v1/jobs"]["post"]["operationId"] == "jobs_submit_job_post"


def test_a_misspelt_query_option_is_refused_as_a_misspelt_form_field_is(stack):
    response = requests.post(
        stack.url("/v1/jobs"),
        params={"maxdet": "1"},
        data=jpeg(64, 64),
        headers={"Content-Type": "image/jpeg"},
        timeout=30,
    )
    assert response.status_code == 400 and response.headers["Content-Type"] == "application/problem+json"
    assert response.json()["invalid_params"] == [
        {"name": "maxdet", "reason": "not a query parameter of this operation"}
    ]
    assert "unknown query parameter(s): 'maxdet'" in response.json()["detail"]
    spelt = requests.post(
        stack.url("/v1/jobs"),
        params={"max_det": "1"},
        data=jpeg(64, 64),
        headers={"Content-Type": "image/jpeg"},
        timeout=30,
    )
    assert spelt.status_code == 202, spelt.text
    # `wait` is one of the submission's query parameters (contract.documents.submit_query_model): never unknown.
    waiting = requests.post(
        stack.url("/v1/jobs"),
        params={"wait": "1"},
        data=jpeg(64, 64),
        headers={"Content-Type": "image/jpeg"},
        timeout=30,
    )
    assert waiting.status_code != 400, waiting.text


@pytest.mark.parametrize("newline", [b"\r\n", b"\n"], ids=["plain form", "LF only: Werkzeug's parser"])
def test_a_form_of_thousands_of_tiny_parts_is_told_so_not_that_it_is_too_large(stack, newline):
    """One image and 2,000 tiny parts (~120 KB) got 413 "exceeds the limit of 20971520 bytes". It is a 400 now,
    naming the limit on parts, from either parser."""
    image = jpeg(64, 64)
    parts = [
        b"--b0"
        + newline
        + b'Content-Disposition: form-data; name="image"; filename="a.jpg"'
        + newline
        + b"Content-Type: image/jpeg"
        + newline
        + newline
        + image
        + newline
    ]
    parts += [
        b"--b0" + newline + b'Content-Disposition: form-data; name="f%d"' % i + newline + newline + b"x" + newline
        for i in range(2000)
    ]
    body = b"".join(parts) + b"--b0--" + newline
    response = requests.post(
        stack.url("/v1/jobs"), data=body, timeout=30, headers={"Content-Type": "multipart/form-data; boundary=b0"}
    )
    assert response.status_code == 400 and response.headers["Content-Type"] == "application/problem+json"
    document = response.json()
    assert document["type"] == "/problems/too-many-parts" and f"more than {MAX_PARTS} parts" in document["detail"]


@pytest.mark.parametrize(
    "url", ["http://no-such-host.invalid/hook", "http://10.0.0.1/hook", "http://[::1]:8080/", "http://127.0.0.2:6379/"]
)
def test_a_refused_callback_url_says_nothing_of_what_its_host_resolves_to(stack, url):
    """ "'vm' resolves to 127.0.0.1" and "does not resolve" told a client what internal names are: every host the
    lookup refuses gets one answer (the reason goes to the API's log)."""
    response = stack.submit(jpeg(64, 64), callback_url=url)
    assert response.status_code == 400
    document = response.json()
    assert [param["name"] for param in document["invalid_params"]] == ["callback_url"]
    assert document["invalid_params"][0]["reason"] == REFUSED_HOST
    for leak in (
        "resolve to",
        "resolves to",
        "does not resolve",
        "10.0.0.1",
        "127.0.0",
        "::1",
        "loopback",
        "private",
        "Name or service",
    ):
        assert leak not in document["detail"].replace(url, ""), document["detail"]
