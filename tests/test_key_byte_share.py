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
    {"id": "team-c", "sha256": hash_key("key-c")},
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


def test_two_keys_padding_their_uploads_leave_room_for_a_third(stack, unserved_api):
    """A key's share is of what the other keys leave: team-a fills half the budget, team-b half of what team-a
    left, and team-c's uploads are still admitted, where two shares of the whole took it all."""
    server, keys = unserved_api
    held: dict[str, int] = {}
    for key, owner in (("key-a", "team-a"), ("key-b", "team-b")):
        for seed in range(20):
            response = post(server, key, padded_jpeg(seed))
            if response.status_code != 202:
                break
        assert response.status_code == 429, response.text  # each flooding key gets its own 429...
        assert "what the other keys leave" in response.json()["detail"], response.json()
        held[owner] = key_bytes(stack, keys, owner)
    assert 0 < held["team-a"] <= MODEL_BUDGET // 2
    # ...team-b's share being half of what team-a left
    assert 0 < held["team-b"] <= (MODEL_BUDGET - held["team-a"]) // 2
    model = stack.settings.model.key
    assert int(stack.redis.hget(keys.waiting_bytes, model) or 0) <= MODEL_BUDGET * 3 // 4 + 2 * PADDING
    third = [post(server, "key-c", padded_jpeg(200 + seed)).status_code for seed in range(2)]
    assert third == [202, 202], third  # the budget's model-wide 429 never came
    assert post(server, "key-a", padded_jpeg(300)).status_code == 429  # nor did the floods get more room


def test_a_keys_share_of_the_backlog_is_of_what_the_other_keys_leave(stack):
    """The job-count share the same way, in the library's admission step on a real Redis: with team-b's queue
    holding 60 of a backlog of 160, team-a may hold half of the 100 left, not 80; alone, the whole 80; and a key
    with nothing waiting is admitted whatever is left, up to the model's own limit."""
    from contract.admission import budget

    keys = Keys("backlogshare")
    model = stack.settings.model.key
    waiting = budget.WaitingBytes(stack.redis, keys)
    tenants = ("", "team-a", "team-b", "team-c")
    queue = {tenant: keys.celery_queue(keys.preprocess_queue(model, tenant)) for tenant in tenants}

    def admit(tenant: str) -> budget.BudgetVerdict:  # a key's share 80; no key's jobs, the whole backlog
        return waiting.admit(model, 0, 160, 10**9, 10**9, tenant, tenants, 80 if tenant else 160, sharded=False)

    try:
        stack.redis.rpush(queue["team-a"], *["job"] * 79)
        assert admit("team-a").verdict == budget.ADMITTED  # alone: 79 + 1 within its 80
        stack.redis.rpush(queue["team-a"], "job")
        refused = admit("team-a")
        assert refused.verdict == budget.OVER_TENANT_BACKLOG and refused.share == 80
        stack.redis.rpush(queue["team-b"], *["job"] * 60)
        stack.redis.ltrim(queue["team-a"], 0, 48)  # 49 of team-a's: a 50th is half of the 100 team-b left
        assert admit("team-a").verdict == budget.ADMITTED
        stack.redis.rpush(queue["team-a"], "job")
        refused = admit("team-a")
        assert refused.verdict == budget.OVER_TENANT_BACKLOG and (refused.backlog, refused.share) == (50, 50)
        assert admit("team-c").verdict == budget.ADMITTED  # 110 of 160: room for the next key
        stack.redis.rpush(queue[""], *["job"] * 50)  # the backlog full: the model's own 429, not a share's
        assert admit("team-c").verdict == budget.OVER_BACKLOG
        assert admit("").verdict == budget.OVER_BACKLOG
    finally:
        stack.redis.delete(*queue.values())


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
