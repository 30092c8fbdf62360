"""The API fuzzed with API keys configured (the auth paths, each key's own queues): its own file, so that
the suite's two pytest processes run it beside tests/test_openapi.py's run without keys."""

from __future__ import annotations

import pytest

from app.auth import hash_key
from tests.support import api_with_keys, run_schemathesis

pytestmark = pytest.mark.integration

FUZZ_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def keyed_api(stack):
    keys = ({"id": "fuzz", "sha256": hash_key(FUZZ_KEY)},)
    with api_with_keys(stack.settings, keys, rate_per_s=1000.0, burst=1000.0) as server:
        yield server


def test_schemathesis_finds_nothing_with_api_keys(keyed_api):
    result = run_schemathesis(keyed_api.url, "--header", f"Authorization: Bearer {FUZZ_KEY}")
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-3000:]
