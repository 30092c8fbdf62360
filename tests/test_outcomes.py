"""Typed outcomes keep their wire text: a CPU stage's outcome is the same string it was (Celery's result, the log
line), and a Redis error's answer comes from the first row of app.problems' table that matches it."""

from __future__ import annotations

import json

import pytest
import redis

from app.problems import REDIS_PROBLEMS, redis_problem
from contract.redis.replication import AnswerNotReplicated, NotReplicated, Unconfirmed
from contract.redis.shards import ShardUnavailable
from tasks.decoding import outcomes
from tasks.decoding.outcomes import Stage, StageOutcome


@pytest.mark.parametrize(
    ("outcome", "text", "kind", "code"),
    [
        (outcomes.PUSHED, "pushed", Stage.PUSHED, ""),
        (outcomes.EXPIRED, "expired", Stage.EXPIRED, ""),
        (outcomes.MISSING, "missing", Stage.MISSING, ""),
        (outcomes.skipped("succeeded"), "skipped (succeeded)", Stage.SKIPPED, ""),
        (outcomes.failed("decode_error"), "failed: decode_error", Stage.FAILED, "decode_error"),
    ],
)
def test_a_stage_outcome_is_the_text_it_always_was(outcome: StageOutcome, text: str, kind: Stage, code: str) -> None:
    assert outcome == text and str(outcome) == text and type(str(outcome)) is str
    assert json.dumps(outcome) == json.dumps(text)  # Celery's JSON result, byte for byte
    assert f"preprocess {outcome}" == f"preprocess {text}"  # the log line's message
    assert outcome.kind is kind and outcome.error_code == code


@pytest.mark.parametrize(
    ("error", "slug", "retry_after"),
    [
        (AnswerNotReplicated(0, 1), "not-replicated", "1"),  # before NotReplicated, whose subclass it is
        (NotReplicated(0, 1), "not-replicated", "1"),
        (ShardUnavailable(2, OSError("down")), "shard-unavailable", "1"),  # before ConnectionError
        (redis.exceptions.OutOfMemoryError("OOM"), "store-full", "60"),
        (Unconfirmed("no majority"), "backend-unavailable", "1"),  # before ConnectionError
        (redis.ConnectionError("refused"), "backend-unavailable", "7"),
        (redis.TimeoutError("slow"), "backend-unavailable", "7"),
        (redis.ResponseError("WRONGTYPE"), "backend-error", "7"),
    ],
)
def test_a_redis_error_is_answered_by_the_first_row_that_matches(
    error: redis.RedisError, slug: str, retry_after: str
) -> None:
    problem = redis_problem(error, retry_after_s=7)
    assert (problem.status, problem.slug, problem.headers) == (503, slug, {"Retry-After": retry_after})
    assert str(error) not in problem.detail  # said as it is, with no exception text
    assert REDIS_PROBLEMS[-1].errors == (redis.RedisError,)  # the last row takes the rest
