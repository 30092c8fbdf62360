"""A submission placed on a cell (docs/cells.md): the cell chosen for it (app.cells), its reservation there, and
its job made there, with one retry on another cell when the chosen one's Redis does not answer.

The first cell that does not answer costs that submission nothing: it is marked down (no new jobs from this process
for `bulk.retry_s`) and the submission goes to another cell, its reservation given back (later, when the cell
answers again) and taken anew there. A cell that fails after the job may have been written (a timeout on the
store) can leave a job nobody reads in it: it runs, and ends, unread. With one cell there is nowhere else to go:
the error is answered as it always was (a 503).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis
from flask import Response, g, url_for

from app import metrics
from app.admission import Reservation, Route, TakeIn
from app.cells import CellServices, cell_unreachable
from app.job_bodies import document_response, job_response
from app.problems import Problem
from app.services import Services
from app.waiters import expire_if_late, until_ended
from contract.documents import JobAccepted, model_ref
from contract.jobs import deadlines
from contract.jobs.ending import LATE_ERROR
from contract.jobs.record import QUEUED, SUCCEEDED, TERMINAL, JobRecord, StoredJSON, utc_iso
from contract.jobs.timebill import RECEIVED_AT
from contract.settings.models import ModelSpec

log = logging.getLogger("api")


@dataclass(frozen=True)
class Submission:
    """A submission read and checked, before any cell holds it."""

    spec: ModelSpec
    data: bytes
    media_type: str
    options: Any  # the submit options' model (app.submission.submit_options)
    deadline_ms: int
    callback_url: str | None
    received_at: float
    wait_s: float


Answer = tuple[Response, int, dict[str, str]]


@dataclass(frozen=True)
class Declared:
    """What a submission says of itself before its body is read: the model's `model=` query, its Content-Length
    (None: chunked), its API key's id, and whether a multipart body may name the model itself."""

    reference: str | None
    length: int | None
    client_id: str
    model_in_form: bool


def submit(
    services: Services, declared: Declared, read: Callable[[], tuple[Route, Callable[[ModelSpec], Submission]]]
) -> Answer:
    """A submission from its reservation to its answer, in one call: reserved before its body is read (`declared`:
    what the request says of itself then), its body read by `read()` (the route's own work: its route, and the
    checks that need its model), then routed and its job made (Placement.take). The reservation stays here and in
    app.admission; whatever refuses it after it was made gives its bytes back."""
    placement = before_body(
        services,
        declared.reference,
        lambda cell: cell.admission.before_body(
            declared.reference, declared.length, client_id=declared.client_id, model_in_form=declared.model_in_form
        ),
    )
    try:
        route, submission_for = read()
        return placement.take(services, route, submission_for)
    except BaseException:
        placement.give_back()  # refused after the reservation: a bad option, Redis away
        raise


class Placement:
    """Where a submission is placed: the cell and the reservation it holds there. It moves at most once."""

    def __init__(self, cell: CellServices, reservation: Reservation) -> None:
        self.cell, self.reservation = cell, reservation
        self.moved = False

    def give_back(self) -> None:
        self.cell.admission.give_back(self.reservation)

    def take(self, services: Services, route: Route, submission_for: Callable[[ModelSpec], Submission]) -> Answer:
        """The submission after its body, one call to its cell's admission (Admission.take): routed (with
        `route`'s model reference, size and cache option), made whole by `submission_for(spec)` (the route's checks
        that need its model), then its job made (_store); in another cell, routed as it was, if that one does not
        answer or has no room. The checks' refusal is the route's own: answered as it is, never a move."""
        checks = _Checks(submission_for)
        client_id = self.reservation.client_id
        for attempt in (0, 1):
            stores = checks.stores
            try:
                answer = self.cell.admission.take(
                    self.reservation, route, _job_in(services, self.cell, client_id, checks)
                )
            except (redis.RedisError, Problem) as exc:
                in_store = checks.stores > stores  # it failed in the store, not in the routing
                # Each step is moved once: a routing after a move, or a second store, fails as it is (_move raises
                # too, once the submission has moved, having counted the cell that did not answer).
                if checks.refused or (checks.stores > 1 if in_store else attempt > 0):
                    raise
                spec = self.reservation.spec
                self._move(services, exc, spec.key if spec else None)
                continue
            metrics.CELL_SUBMITTED.labels(self.cell.name).inc()
            return answer
        raise AssertionError("a submission moves once: _move raised")

    def _move(self, services: Services, exc: Exception, model_key: str | None) -> None:
        """To another cell that is up, its reservation here given back; `exc` again when there is none."""
        other = None if self.moved else services.cells.instead_of(self.cell, exc, model_key)
        if cell_unreachable(exc):
            metrics.CELL_UNANSWERED.labels(self.cell.name).inc()
        if other is None:
            raise exc
        log.warning(
            "cell %s failed a submission (%s); it goes to cell %s", self.cell.name, type(exc).__name__, other.name
        )
        self.give_back()
        moved = Reservation(client_id=self.reservation.client_id, spec=self.reservation.spec)  # routed as it was
        self.cell, self.reservation, self.moved = other, moved, True


class _Checks:
    """The route's checks that need the model, made once: a submission moved after them is not checked again."""

    def __init__(self, submission_for: Callable[[ModelSpec], Submission]) -> None:
        self.submission_for = submission_for
        self.submission: Submission | None = None
        self.refused = False  # they raised: the route's answer, not the cell's
        self.stores = 0  # the stores begun, each after the checks

    def __call__(self, spec: ModelSpec) -> Submission:
        if self.submission is None:
            try:
                self.submission = self.submission_for(spec)
            except BaseException:
                self.refused = True
                raise
        self.stores += 1
        return self.submission


def _job_in(
    services: Services, cell: CellServices, client_id: str, checks: _Checks
) -> Callable[[ModelSpec, TakeIn], Answer]:
    """What Admission.take calls back once routed: the checks, then the job made in `cell` with its `take_in`."""
    return lambda spec, take_in: _store(services, cell, client_id, checks(spec), take_in)


def before_body(services: Services, reference: str | None, reserve: Callable[[CellServices], Reservation]) -> Placement:
    """The cell a new submission goes to, and `reserve`'s reservation there (app.admission's before_body); another
    cell's when the chosen one does not answer."""
    cell = services.cells.choose(reference)
    try:
        return Placement(cell, reserve(cell))
    except (redis.RedisError, Problem) as exc:
        other = services.cells.instead_of(cell, exc, reference)
        if cell_unreachable(exc):
            metrics.CELL_UNANSWERED.labels(cell.name).inc()
        if other is None:
            raise
        log.warning("cell %s failed a submission (%s); it goes to cell %s", cell.name, type(exc).__name__, other.name)
        placement = Placement(other, reserve(other))
        placement.moved = True
        return placement


def _store(services: Services, cell: CellServices, client_id: str, submission: Submission, take_in: TakeIn) -> Answer:
    """The submission's job made in `cell`: its id there, the cache's answer or its admission, the job and its task
    stored, and with `wait` the wait for its end."""
    spec, data, received_at = submission.spec, submission.data, submission.received_at
    task = services.task_messages.build
    options, media_type, callback_url = submission.options, submission.media_type, submission.callback_url
    deadline_ms = submission.deadline_ms
    # Checked against the key it is issued to (contract.jobs.ids), on a shard not found down lately.
    job_id = cell.store.bulk.new_job_id(lambda: services.job_ids.new(client_id, cell=cell.index))
    fields = {
        "model": spec.key,
        RECEIVED_AT: received_at,
        "deadline_at": deadlines.deadline_at(received_at, deadline_ms),
        "options": options.for_model(),
        "media_type": media_type,
        "bytes": len(data),
        **({"owner": client_id} if client_id else {}),
        **({"callback_url": callback_url} if callback_url else {}),
    }
    # With wait: listening before the job exists, so an end that comes before the wait starts still wakes it.
    event = cell.listener.register(job_id) if submission.wait_s > 0 else None
    try:
        # The key's own queue, as admitted (fairness). The job and its Celery task in one step, with its admission
        # and the cache's lookup: a Redis that is down is a 503 for both, never half.
        answered = take_in(job_id, data, fields, lambda queue: (cell.keys.celery_queue(queue), task(job_id, queue)))
        if answered is not None:  # the cache's: the job is over already, stored as the 202 says
            (status, document), stored, timings = answered
            log.info("job answered from the cache", extra={"job_id": job_id, "model": spec.key, "status": status})
            if submission.wait_s > 0:
                return _finished(cell, job_id, spec)
            # The answer itself in the 202: a client need not poll (it may: the job is there, as said here).
            answer = (
                {"result": StoredJSON(document), "timings_ms": timings}
                if status == SUCCEEDED
                else {"error": json.loads(LATE_ERROR)}
            )
            return _accepted(cell, job_id, spec, stored, status, answer)
        log.info(
            "job accepted", extra={"job_id": job_id, "bytes": len(data), "media_type": media_type, "model": spec.key}
        )
        if event is None:
            return _accepted(cell, job_id, spec, fields, QUEUED)
        try:
            waiting = cast(JobRecord, {"id": job_id, "status": QUEUED, **fields})
            record = until_ended(cell.store, job_id, waiting, submission.wait_s, event)
            record = expire_if_late(cell.store, record)  # a wait ended by the deadline: over, one way or another
        except redis.RedisError:  # the job is stored: its 202 says where, whatever the wait met
            log.warning("a submission's wait lost Redis; answering 202", extra={"job_id": job_id})
            return _accepted(cell, job_id, spec, fields, QUEUED)
    finally:
        if event is not None:
            cell.listener.unregister(job_id, event)
    if record["status"] in TERMINAL:
        return _finished(cell, job_id, spec, record)
    return _accepted(cell, job_id, spec, fields, record["status"])


def _finished(
    cell: CellServices, job_id: str, spec: ModelSpec, record: JobRecord | None = None
) -> tuple[Response, int, dict[str, str]]:
    """The 200 of a submission that waited and saw its job end: the job as a read answers it."""
    record = record or cell.store.load(job_id)
    if record is None:  # gone already (a TTL of seconds): the 202 still tells where it was
        return _accepted(cell, job_id, spec, {RECEIVED_AT: g.received_at}, QUEUED)
    try:
        cell.store.confirm_durable()  # an end a failover could take back is not shown
    except redis.RedisError:  # AnswerNotReplicated, Unconfirmed: the job itself is stored; a 503 would hide its id
        return _accepted(cell, job_id, spec, {RECEIVED_AT: record.get(RECEIVED_AT, g.received_at)}, QUEUED)
    metrics.SUBMITTED.labels(spec.name, spec.version, cell.name).inc()
    return job_response(record), 200, {"Content-Location": url_for("jobs.get_job", job_id=job_id)}


def _accepted(
    cell: CellServices, job_id: str, spec: ModelSpec, fields: dict, status: str, answer: dict | None = None
) -> tuple[Response, int, dict[str, str]]:
    metrics.SUBMITTED.labels(spec.name, spec.version, cell.name).inc()
    location = url_for("jobs.get_job", job_id=job_id)
    # A cached result is spliced in as stored, as a read serves it (app.job_bodies).
    stored = {name: value for name, value in (answer or {}).items() if isinstance(value, StoredJSON)}
    body = JobAccepted.model_validate(
        {
            "id": job_id,
            "status": status,
            "model": model_ref(spec.key),
            "links": {"self": location},
            **({"cache": fields["cache"]} if "cache" in fields else {}),
            "created_at": utc_iso(fields[RECEIVED_AT]),
            **(answer or {}),
            **dict.fromkeys(stored),
        }
    )
    return document_response(body.to_json(), stored), 202, {"Location": location}
