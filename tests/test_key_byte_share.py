"""One API key's share of the byte budgets (auth.max_waiting_bytes_share): a key that pads its uploads fills its
own share and gets its own 429, while another key's jobs are still admitted; whatever ends its jobs gives its
share back, to the byte."""

from __future__ import annotations

import dataclasses

import pytest
import requests

from app import create_app
from app.auth import hash_key
from contract.redis.keys import Keys
from tests.support import ApiServer, as_key, jpeg, wait_until

pytestmark = pytest.mark.integration

KEYS = (
    {"id": "team-a", "sha256": hash_key("key-a")},
    {"id": "team-b", "sha256": hash_key("key-b")},
)
UPLOAD_LIMIT = 1024 * 1024
MODEL_BUDGET = 4 * UPLOAD_LIMIT  # a key's share: half of it, 2 MiB
PADDING = 300 * 1024


@pytest.fixture
def unserved_api(stack):
    """The stack's app with API keys and small byte budgets, under a namespace no worker takes jobs from: what
    is admitted stays waiting until the test ends it."""
    settings = dataclasses.replace(
        stack.settings,
        namespace="keybytes",
        api=dataclasses.replace(stack.settings.api, max_upload_bytes=UPLOAD_LIMIT),
        auth=dataclasses.replace(stack.settings.auth, api_keys=KEYS, rate_per_s=0.0),
        backpressure=dataclasses.replace(
            stack.settings.backpressure, max_waiting_bytes=MODEL_BUDGET, max_total_waiting_bytes=2 * MODEL_BUDGET
        ),
    )
    keys = Keys(settings.namespace)
    server = ApiServer(create_app(settings))
    yield server, keys
    server.stop()
    stack.redis.delete(*stack.redis.keys(f"{settings.namespace}:*"))


def padded_jpeg(seed: int) -> bytes:
    """A small JPEG with zeros after its end: a decoder reads the image and ignores the rest."""
    return jpeg(64, 48, seed=seed) + bytes(PADDING)


def post(server: ApiServer, key: str, data: bytes, **params: str) -> requests.Response:
    return requests.post(
        server.url + "/v1/jobs",
        data=data,
        params=params,
        timeout=30,
        headers={"Content-Type": "image/jpeg", **as_key(key)},
    )


def key_bytes(stack, keys: Keys, owner: str) -> int:
    """What the key's counters hold, every model together."""
    return sum(max(0, int(value)) for value in stack.redis.hvals(keys.key_waiting_bytes(owner)))


def test_a_key_that_pads_its_uploads_fills_only_its_share_of_the_byte_budget(stack, unserved_api):
    server, keys = unserved_api
    accepted = []
    refused = None
    for seed in range(20):  # its share holds 6 of them; the model's budget 13
        response = post(server, "key-a", padded_jpeg(seed))
        if response.status_code != 202:
            refused = response
            break
        accepted.append(response.json()["id"])
    assert refused is not None and 3 <= len(accepted) <= 7, (len(accepted), refused and refused.text)
    assert refused.status_code == 429, refused.text
    assert refused.headers["Content-Type"].startswith("application/problem+json")
    problem = refused.json()
    assert problem["type"] == "/problems/overloaded"
    assert "your share" in problem["detail"] and str(MODEL_BUDGET // 2) in problem["detail"], problem
    assert int(refused.headers["Retry-After"]) >= 1
    assert 0 < key_bytes(stack, keys, "team-a") <= MODEL_BUDGET // 2

    other = post(server, "key-b", padded_jpeg(100))
    assert other.status_code == 202, other.text  # another key is admitted beside team-a's full share
    assert post(server, "key-a", padded_jpeg(101)).status_code == 429  # team-a still is not

    for job_id in [*accepted, other.json()["id"]]:
        response = requests.delete(f"{server.url}/v1/jobs/{job_id}", headers=as_key("key-a"), timeout=10)
        if response.status_code == 404:  # team-b's
            response = requests.delete(f"{server.url}/v1/jobs/{job_id}", headers=as_key("key-b"), timeout=10)
        assert response.status_code in (200, 202), response.text
    assert key_bytes(stack, keys, "team-a") == 0 and key_bytes(stack, keys, "team-b") == 0
    assert post(server, "key-a", padded_jpeg(102)).status_code == 202  # its share is its own again


def test_a_keys_share_is_given_back_when_its_jobs_expire(stack, unserved_api):
    server, keys = unserved_api
    for seed in range(3):
        response = post(server, "key-a", padded_jpeg(seed), deadline_ms="300")
        assert response.status_code == 202, response.text
    assert key_bytes(stack, keys, "team-a") > 3 * PADDING
    # the API's sweeper ends them at their deadline, and their bytes go with them
    wait_until(lambda: key_bytes(stack, keys, "team-a") == 0, 10, what="team-a's share to be given back")
    model = stack.settings.model.key
    assert int(stack.redis.hget(keys.waiting_bytes, model) or 0) == 0


def test_a_refusal_by_the_total_share_names_the_keys_share_of_every_models_budget():
    """The key's share of the total (max_total_waiting_bytes) refuses it as its own too: 429, naming that share."""
    from app.byte_shares import key_share_refusal
    from contract.admission import budget
    from contract.settings.models import ModelSpec

    spec = ModelSpec(name="m", version="1", labels=["thing"])
    request = budget.AdmissionRequest(
        "m:1", 300, 10, 1000, 1500, owner="a", max_owner_model_bytes=500, max_owner_all_bytes=700
    )
    over_all = budget.BudgetVerdict(budget.OVER_KEY_ALL_BYTES, 0, 100, 900, 650)
    problem = key_share_refusal(spec, request, over_all, lambda _spec, share: 7)
    assert problem is not None and problem.status == 429 and problem.headers["Retry-After"] == "7"
    assert "650 bytes of images waiting for all models" in problem.detail and "is 700" in problem.detail
    admitted = budget.BudgetVerdict(budget.ADMITTED, 0, 100, 900, 650)
    assert key_share_refusal(spec, request, admitted, lambda _spec, share: 7) is None
