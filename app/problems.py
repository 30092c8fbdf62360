"""RFC 9457 problem details: every API error is JSON of one shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import redis
from flask import Response, jsonify

from app.drain import MAX_RETRY_AFTER_S
from app.metrics import count_reject, request_route
from contract.documents import PROBLEM_TYPE, ProblemDocument
from contract.redis.replication import AnswerNotReplicated, NotReplicated, Unconfirmed
from contract.redis.shards import ShardUnavailable


class Problem(Exception):
    """Raise anywhere in a request to answer with a problem document."""

    def __init__(
        self, status: int, slug: str, title: str, detail: str, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(detail)
        self.status, self.slug, self.title, self.detail = status, slug, title, detail
        self.headers = headers or {}
        self.extra = extra


def problem_document(problem: Problem) -> Any:
    """The answer's body: the RFC 9457 document (contract.documents' ProblemDocument), as JSON-ready values."""
    return ProblemDocument(
        type=f"/problems/{problem.slug}",
        title=problem.title,
        status=problem.status,
        detail=problem.detail,
        **problem.extra,
    ).to_json()


def problem_response(problem: Problem) -> Response:
    count_reject(problem.slug, problem.status, request_route())
    response = jsonify(problem_document(problem))
    response.status_code = problem.status
    response.mimetype = PROBLEM_TYPE
    response.headers.update(problem.headers)
    return response


def problem_wsgi(problem: Problem, route: str, start_response: Callable[..., Any]) -> list[bytes]:
    """The same answer given before Flask is called (app.early_refusal) on `route` (the rule the app would have
    matched): the same document and headers (with the ones the app adds to every answer), the refusal counted
    the same."""
    count_reject(problem.slug, problem.status, route)
    body = json.dumps(problem_document(problem)).encode()
    reason = HTTPStatus(problem.status).phrase.upper()
    start_response(
        f"{problem.status} {reason}",
        [
            ("Content-Type", PROBLEM_TYPE),
            ("Content-Length", str(len(body))),
            *problem.headers.items(),
            ("X-Content-Type-Options", "nosniff"),
        ],
    )
    return [body]


def job_lost(job_id: str, issued_at: str) -> Problem:
    """A read of a job the service accepted and no longer holds (contract.jobs.record.lost_at): not a bare 404,
    so that its client knows to send it again."""
    return Problem(
        410,
        "job-lost",
        "Job lost",
        f"job {job_id!r} was accepted at {issued_at} and its record should still be here, but the job store no "
        "longer holds it (lost with a Redis server: docs/reliability.md says when); submit the image again",
    )


@dataclass(frozen=True)
class RedisProblem:
    """How one kind of Redis error is answered: always a 503, said as it is, with no exception text."""

    errors: tuple[type[Exception], ...]
    slug: str
    detail: str
    retry_after_s: int | None = None  # None: the deployment's backpressure.retry_after_s


# Read in order, the first match answers: AnswerNotReplicated is a NotReplicated, and the last row takes the rest.
REDIS_PROBLEMS = (
    # How it ended is not on the replicas yet: ask again.
    RedisProblem(
        (AnswerNotReplicated,),
        "not-replicated",
        "the job ended, but its end is not yet on enough replicas to be shown; read it again",
        1,
    ),
    # Stored on the primary only: withdrawn; a retry may well succeed.
    RedisProblem(
        (NotReplicated,),
        "not-replicated",
        "the job could not be stored on enough replicas in time and was withdrawn; retry",
        1,
    ),
    # Only this job's shard: the next submit goes to another.
    RedisProblem(
        (ShardUnavailable,),
        "shard-unavailable",
        "the store for this job's upload is unreachable; retry (a new job is placed on another)",
        1,
    ),
    RedisProblem(
        (redis.exceptions.OutOfMemoryError,), "store-full", "the job store is full; retry later", MAX_RETRY_AFTER_S
    ),
    # This process cannot tell it writes to the primary that will last.
    RedisProblem(
        (Unconfirmed,),
        "backend-unavailable",
        "the job store's primary is not confirmed by a majority of its Sentinels; retry",
        1,
    ),
    RedisProblem((redis.ConnectionError, redis.TimeoutError), "backend-unavailable", "the job store is unreachable"),
    RedisProblem((redis.RedisError,), "backend-error", "the job store refused the request"),
)


def redis_problem(exc: redis.RedisError, retry_after_s: int) -> Problem:
    """A Redis error's answer (REDIS_PROBLEMS' first match): full, unreachable, or refusing for another reason."""
    row = next(row for row in REDIS_PROBLEMS if isinstance(exc, row.errors))
    seconds = retry_after_s if row.retry_after_s is None else row.retry_after_s
    return Problem(503, row.slug, "Service unavailable", row.detail, headers={"Retry-After": str(seconds)})
