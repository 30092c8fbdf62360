"""The jobs resource: submit an image, read (or long-poll) its job."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext

from flask import Blueprint, Response, g, request

from app import placing
from app.holds import BodyHold
from app.job_bodies import job_response
from app.job_lookup import owned, read
from app.openapi import Reply, image_body, operation
from app.problems import Problem
from app.services import Services
from app.services import services as current_services
from app.submission import checked_callback_url, read_submission, submit_options, submit_query, wait_seconds
from app.uploads import (
    check_image,
    declared_length,
    option_values,
    validate_params,
)
from contract.documents import JobAccepted, JobDocument, wait_query_model
from contract.jobs import deadlines
from contract.jobs.ending import REDELIVER_QUEUED
from contract.jobs.record import (
    CANCELLED,
    TERMINAL,
)
from contract.settings.models import ModelSpec

blueprint = Blueprint("jobs", __name__, url_prefix="/v1/jobs")
log = logging.getLogger("api")


@blueprint.post("")
@operation(
    "Submit an image for detection",
    tag="jobs",
    problems=(
        (
            400,
            "An option is invalid or unknown (named in `invalid_params`), the image is empty, "
            "missing or given twice, the form has more than 64 parts, the body is shorter than its "
            "Content-Length or its chunked framing is broken, callbacks are disabled, or callback_url's host "
            "did not resolve within `callbacks.lookup_timeout_s`",
        ),
        (404, "`model` names no model this deployment takes jobs for (`models` lists them)"),
        413,
        415,
        (
            429,
            "The model's backlog (jobs waiting) or its bytes of images waiting are over their limits "
            "(`backpressure.max_backlog`, `backpressure.max_waiting_bytes`), or so is your key's share of the backlog, "
            "its unfinished callback_url lookups or the bytes its answers (computed and cache hits) stored "
            "(`jobs.answer_bytes_per_key`); nothing was taken: retry after `Retry-After` seconds",
        ),
        (
            503,
            "The job store is full (every model's bytes waiting over `backpressure.max_total_waiting_bytes`, or "
            "Redis near its maxmemory), unreachable or refusing, or this process is busy; nothing was taken: "
            "retry after `Retry-After` seconds",
        ),
    ),
    description="Options may come as query parameters or, with a multipart body, as form fields. "
    "`wait=S` (query only) makes it one call: the finished job comes back (200) if it ends "
    "within S seconds, else the 202 comes then.",
    query=submit_query,
    body=lambda settings: image_body(settings, submit_options(settings)),
    replies={
        200: Reply(
            "With `wait`: the job ended within it (any end: `succeeded`, `failed`, `expired` "
            "or `cancelled`); the same document a read answers",
            JobDocument,
            headers=("Content-Location",),
        ),
        202: Reply(
            "Accepted: poll the job at `Location`",
            JobAccepted,
            headers=("Location",),
            links={
                name: {"operationId": target, "parameters": {"job_id": "$response.body#/id"}}
                for name, target in (("ReadJob", "jobs_get_job_get"), ("CancelJob", "jobs_cancel_job_delete"))
            },
        ),
    },
)
def submit_job() -> placing.Answer:
    services = current_services()
    # A misspelt query option (`maxdet=1`) was refused before this (app.queries), before the body is read.
    wait_s = wait_seconds(services.settings.api.max_wait_s)  # refused before the body is read
    length = declared_length(request.environ, services.settings.api.max_upload_bytes)
    # A long-poll and a body each hold this process's memory and a connection: counted (app.holds) before
    # anything is read, and refused at once past the client's or the process's bounds.
    client = g.get("client_id") or ""
    hold = BodyHold(services.holds, client)
    with services.holds.wait(client, wait_s) if wait_s > 0 else nullcontext(), hold:
        hold.take(length or 0)  # a chunked body's bytes are taken as they come (read_submission)
        declared = placing.Declared(
            request.args.get("model"),
            length,
            client,
            model_in_form="model" not in request.args and request.mimetype == "multipart/form-data",
        )
        # One call to the placement: the reservation is made, routed and taken in within app.placing and
        # app.admission, which call back here for the body (_accept).
        return placing.submit(services, declared, lambda: _accept(services, wait_s, hold))


def _accept(
    services: Services, wait_s: float, hold: BodyHold
) -> tuple[placing.Route, Callable[[ModelSpec], placing.Submission]]:
    """The route's own work on the body: read and checked, its options validated; its route (the model's reference,
    the body's size, the cache option) and the checks that need the model it is routed to."""
    settings = services.settings
    options_model = submit_options(settings)
    data, declared_type, form = read_submission(request, settings.api, fields=options_model.model_fields, hold=hold)
    media_type = check_image(data, declared_type)
    values = option_values(request.args, form, names=options_model.model_fields)
    options = validate_params(options_model, values)

    def submission_for(spec: ModelSpec) -> placing.Submission:
        """The checks that need the model the submission was routed to."""
        try:
            deadline_ms = deadlines.applied_deadline_ms(
                options.deadline_ms, settings.default_deadline_ms(spec), spec.key
            )
        except deadlines.DeadlineTooLong as exc:
            raise Problem(
                400,
                "invalid-parameter",
                "Invalid parameter",
                str(exc),
                invalid_params=[{"name": "deadline_ms", "reason": exc.reason}],
            ) from None
        callback_url = checked_callback_url(options.callback_url, settings)
        return placing.Submission(spec, data, media_type, options, deadline_ms, callback_url, g.received_at, wait_s)

    return (options.model, len(data), options.cache), submission_for


@blueprint.get("/<job_id>")
@operation(
    "Read a job, optionally waiting for it to end",
    tag="jobs",
    problems=(
        (400, "`wait` is not a number of seconds in range"),
        404,
        (410, "Accepted from this key, then lost: submit it again"),
        (429, "Long-polls at their bound"),
        503,
    ),
    query=lambda settings: wait_query_model(settings.api.max_wait_s),
    replies={200: Reply("The job", JobDocument)},
)
def get_job(job_id: str) -> Response:
    services = current_services()
    wait_s = wait_seconds(services.settings.api.max_wait_s)
    cell, record = read(services, job_id, wait_s)  # the id checked, placed and read in one facade (app.job_lookup)
    if record["status"] in TERMINAL:
        cell.store.confirm_durable()  # an end a failover could take back is not shown
    return job_response(record)


@blueprint.delete("/<job_id>")
@operation(
    "Cancel a job that has not ended",
    tag="jobs",
    problems=(404, 409, 503),
    replies={200: Reply("The job, now cancelled", JobDocument)},
)
def cancel_job(job_id: str) -> Response:
    """A live job becomes `cancelled` and whichever stage sees it next skips it; an ended job is 409."""
    services = current_services()
    asked, _ = owned(services, job_id)
    store = asked.cell.store
    cancelled = store.finish(job_id, CANCELLED, {"error": {"code": "cancelled", "message": "cancelled by the client"}})
    record = store.load(job_id)
    if not cancelled or record is None:
        status = record["status"] if record else "gone"
        raise Problem(
            409,
            "job-already-finished",
            "Job already finished",
            f"job {job_id!r} ended as {status!r} and cannot be cancelled",
        )
    store.drop_upload(job_id)
    store.confirm_durable()  # a cancellation a failover could take back is not shown either
    log.info("job cancelled", extra={"job_id": job_id})
    return job_response(record)


@blueprint.post("/<job_id>/callback")
@operation(
    "Deliver an ended job's callback again, from its first attempt",
    tag="jobs",
    problems=(404, (409, "The job has no callback, or has not ended yet (its callback is sent then)"), 503),
    description="For a callback given up (`callback.status` failed: the dead letter) or one the receiver "
    "lost. The delivery keeps its X-Imgserve-Delivery-Id, so a receiver that saw it drops it. One is queued "
    "at a time: while one is `pending` or `delivering`, or in the 10 s after one was `delivered`, a request "
    "answers with it and queues nothing.",
    replies={202: Reply("Queued again, or already queued or under way (`callback.status` says)", JobDocument)},
)
def redeliver_callback(job_id: str) -> tuple[Response, int]:
    services = current_services()
    asked, record = owned(services, job_id)
    store = asked.cell.store
    if not record.get("callback_url"):
        raise Problem(409, "no-callback", "No callback", f"job {job_id!r} was submitted without a callback_url")
    outcome = store.redeliver_callback(job_id)
    if not outcome:
        raise Problem(
            409,
            "job-not-finished",
            "Job not finished",
            f"job {job_id!r} has not ended: its callback is sent when it does",
        )
    if outcome == REDELIVER_QUEUED:
        log.info("callback queued again", extra={"job_id": job_id})
    return job_response(store.load(job_id) or record), 202
