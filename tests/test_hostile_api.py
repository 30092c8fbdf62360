"""Hostile clients, round four, against the API: metrics labels that anyone could multiply, an expensive page
anyone could ask for, answers that told too much or too little. Each attack, and what it gets now."""
from __future__ import annotations

import random
import string

import pytest
import requests

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
    session.request("XWARMUP", gunicorn_api.url + "/healthz", timeout=10)   # `other`'s own series, once
    session.get(gunicorn_api.url + "/no-such-path", timeout=10)
    session.get(gunicorn_api.url + "/metrics", timeout=10)                 # and the scrape's own
    before = series(session.get(gunicorn_api.url + "/metrics", timeout=10).text)
    statuses = set()
    for i in range(1000):
        path = "/healthz" if i % 2 else f"/{random_token(rng, 12).lower()}"
        statuses.add(session.request("X" + random_token(rng, 9), gunicorn_api.url + path, timeout=10).status_code)
    after = series(session.get(gunicorn_api.url + "/metrics", timeout=10).text)
    assert statuses <= {404, 405}, statuses          # the attack reached the app: each was answered there
    new = after - before
    assert len(new) < 10, sorted(new)[:20]
    assert any('method="other"' in line for line in after)
