"""Issue 70, "every accepted request is charged somewhere": a computed job's answer is charged to its API key, as a
cache hit's is. A key computing big answers at the GPU's rate filled Redis, since only hits took bytes from the key's
bucket. Now the GPU worker's batch write takes each key's answers from it (`jobs.answer_bytes_per_key`), into debt
if it must (the answer is never lost), and the admission refuses a key in debt with its own 429 until the refill has
paid it. On a real stack: the API over HTTP, a Celery worker, a GPU worker, Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import requests

from app.auth import hash_key
from tests.conftest import Stack, content_box_spec, start_stack, stop_stack
from tests.support import as_key, jpeg

pytestmark = pytest.mark.integration

KEYS = [{"id": "team-a", "sha256": hash_key("key-a")}, {"id": "team-b", "sha256": hash_key("key-b")}]
BUCKET = 4000  # a few of the test model's answers (each ~1 KB stored: its result, time bill and batch)
TTL_S = 60  # the bucket refills BUCKET per TTL_S: ~67 bytes a second


@pytest.fixture(scope="module")
def answer_stack(redis_server, tmp_path_factory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("answers")
    url = redis_server.url.rsplit("/", 1)[0] + "/4"
    extra = {
        "auth": {"api_keys": KEYS, "rate_per_s": 0.0},
        "jobs": {"ttl_s": TTL_S, "answer_bytes_per_key": BUCKET},
    }
    stack = start_stack(url, workdir, content_box_spec(workdir, 64), "answers", extra)
    yield stack
    stop_stack(stack)


def submit(stack: Stack, key: str, seed: int) -> requests.Response:
    headers = {"Content-Type": "image/jpeg", **as_key(key)}
    return requests.post(stack.api.url + "/v1/jobs", data=jpeg(96, 80, seed=seed), headers=headers, timeout=30)


def answered(stack: Stack, key: str, job_id: str) -> dict:
    response = requests.get(f"{stack.api.url}/v1/jobs/{job_id}", params={"wait": 30}, headers=as_key(key), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_keys_computed_answers_overdraw_its_bucket_and_it_is_refused_until_paid_while_another_key_is_not(
    answer_stack,
):
    stack = answer_stack
    started = time.monotonic()
    done: list[dict] = []
    refused = None
    for seed in range(30):  # one at a time, each answered before the next: the bucket is debited as they end
        response = submit(stack, "key-a", seed)
        if response.status_code != 202:
            refused = response
            break
        done.append(answered(stack, "key-a", response.json()["id"]))
    elapsed = time.monotonic() - started
    assert refused is not None, f"{len(done)} jobs and never refused"
    assert refused.status_code == 429, refused.text
    assert refused.headers["Content-Type"] == "application/problem+json"
    problem = refused.json()
    assert problem["type"] == "/problems/rate-limited" and "answer_bytes_per_key" in problem["detail"], problem
    assert int(refused.headers["Retry-After"]) >= 1

    # nothing computed was lost: the job whose answer overdrew the bucket is as readable as the others
    assert len(done) >= 2 and all(doc["status"] == "succeeded" and doc["result"] for doc in done)
    # and what the key's answers stored is bounded by the bucket and its refill, past it by one answer at most
    results = [len(json.dumps(doc["result"], separators=(",", ":"))) for doc in done]
    assert sum(results[:-1]) <= BUCKET + BUCKET / TTL_S * elapsed, (results, elapsed)

    tokens, _mark = stack.redis.get(stack.keys.hit_bucket("team-a")).split()
    debt = -float(tokens)
    assert debt > 0
    print(f"{len(done)} answers ({sum(results)} bytes of results) in {elapsed:.1f} s, then a debt of {debt:.0f}")
    left_ms = stack.redis.pttl(stack.keys.answer_debt("team-a"))
    assert 0 < left_ms <= debt / (BUCKET / TTL_S) * 1000 + 1
    assert int(refused.headers["Retry-After"]) <= left_ms / 1000 + 2

    other = submit(stack, "key-b", 100)  # another key is admitted beside team-a's debt
    assert other.status_code == 202, other.text
    assert answered(stack, "key-b", other.json()["id"])["status"] == "succeeded"
    assert submit(stack, "key-a", 101).status_code == 429  # team-a still is not

    # paid: its debt marker gone (as the refill would), the key is admitted again
    stack.redis.delete(stack.keys.answer_debt("team-a"), stack.keys.hit_bucket("team-a"))
    again = submit(stack, "key-a", 102)
    assert again.status_code == 202, again.text
    assert answered(stack, "key-a", again.json()["id"])["status"] == "succeeded"


def test_take_in_bounded_refuses_a_key_in_debt_and_plain_take_in_is_called_as_before(redis_client):
    """The debt's check is take_in_bounded's (keys[8], the key's debt marker); `take_in`, called as an API without
    the answer bucket calls it (seven keys before admit()'s), makes the job as before."""
    from contract.library import Step
    from contract.redis.keys import Keys

    keys = Keys("answer-debt")
    redis_client.set(keys.answer_debt("team-a"), "1", px=5000)

    def call(step: str, job_id: str, owner: str) -> list:
        names = ["", keys.job(job_id), keys.deadlines, "", "", "", keys.waiting_bytes]
        if step in ("take_in_bounded", "take_in_job"):
            names.append(keys.answer_debt(owner))
        redis_client.hset(keys.job(job_id), mapping={"status": "queued", "owner": owner})
        return Step(step)(redis_client, names, ["m:1", owner, 0, job_id])

    refused = call("take_in_bounded", "a" * 32, "team-a")
    assert refused[0] == b"answer_debt" and 0 < int(refused[1]) <= 5000
    assert not redis_client.exists(keys.job("a" * 32))  # its writes taken back
    assert call("take_in_bounded", "b" * 32, "team-b")[0] == b"created"  # another key
    assert call("take_in", "c" * 32, "team-a")[0] == b"created"  # the plain call: no check, as before
    # take_in_job (library 10, this release's API): the same step, a job made answered with 1 alone
    refused = call("take_in_job", "d" * 32, "team-a")
    assert refused[0] == b"answer_debt" and 0 < int(refused[1]) <= 5000
    assert not redis_client.exists(keys.job("d" * 32))
    assert call("take_in_job", "e" * 32, "team-b") == 1 and redis_client.exists(keys.job("e" * 32))
