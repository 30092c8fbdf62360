"""RFC 9457 problem details: every API error is JSON of one shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from flask import Response, jsonify

from app.metrics import count_reject, request_route
from contract.documents import PROBLEM_TYPE, ProblemDocument


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
