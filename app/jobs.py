"""The jobs resource: submit an image, read (or long-poll) its job."""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from typing import cast

import redis
from flask import Blueprint, Response, g, request, url_for

from app import decode_charges, metrics
from app.admission import Reservation
from app.holds import BodyHold
from app.job_bodies import document_response, job_response
from app.job_lookup import is_ours_to_ask, load_owned
from app.openapi import image_body
from app.operations import Reply, operation
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
from app.waiters import expire_if_late, until_ended
from contract import deadlines
from contract.clock import now as service_now
from contract.documents import JobAccepted, JobDocument, model_ref, wait_query_model
from contract.jobs.ending import LATE_ERROR, REDELIVER_QUEUED
from contract.jobs.record import (
    CANCELLED,
    QUEUED,
    SUCCEEDED,
    TERMINAL,
    JobRecord,
    StoredJSON,
    utc_iso,
)
from contract.models import ModelSpec
from contract.replication import NotReplicated
from contract.timebill import RECEIVED_AT, SUBMITTED_AT

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
            "its unfinished callback_url lookups or (a cache hit) the bytes its hits stored "
            "(`cache.hit_bytes_per_key`); nothing was taken: retry after `Retry-After` seconds",
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
def submit_job() -> tuple[Response, int, dict[str, str]]:
    services = current_services()
    # A misspelt query option (`maxdet=1`) was refused before this (app.queries), before the body is read.
    wait_s = wait_seconds(services.settings.api.max_wait_s)  # refused before the body is read
    declared = declared_length(request.environ, services.settings.api.max_upload_bytes)
    # A long-poll and a body each hold this process's memory and a connection: counted (app.holds) before
    # anything is read, and refused at once past the client's or the process's bounds.
    client = g.get("client_id") or ""
    hold = BodyHold(services.holds, client)
    with services.holds.wait(client, wait_s) if wait_s > 0 else nullcontext(), hold:
        hold.take(declared or 0)  # a chunked body's bytes are taken as they come (read_submission)
        reservation = services.admission.before_body(
            request.args.get("model"),
            declared,
            client_id=client,
            model_in_form="model" not in request.args and request.mimetype == "multipart/form-data",
        )
        try:
            return _accept(services, reservation, wait_s, hold)
        except BaseException:
            services.admission.give_back(reservation)  # refused after the reservation: a bad option, Redis away
            raise


def _accept(
    services: Services, reservation: Reservation, wait_s: float, hold: BodyHold
) -> tuple[Response, int, dict[str, str]]:
    settings = services.settings
    options_model = submit_options(settings)
    data, declared_type, form = read_submission(request, settings.api, fields=options_model.model_fields, hold=hold)
    media_type = check_image(data, declared_type)
    values = option_values(request.args, form, names=options_model.model_fields)
    options = validate_params(options_model, values)
    spec = services.admission.route_body(reservation, options.model, len(data), options.cache)
    try:
        deadline_ms = deadlines.applied_deadline_ms(options.deadline_ms, settings.default_deadline_ms(spec), spec.key)
    except deadlines.DeadlineTooLong as exc:
        raise Problem(
            400,
            "invalid-parameter",
            "Invalid parameter",
            str(exc),
            invalid_params=[{"name": "deadline_ms", "reason": exc.reason}],
        ) from None
    callback_url = checked_callback_url(options.callback_url, settings)
    received_at = g.received_at
    # Checked against the key it is issued to (contract.jobs.ids), on a shard not found down lately.
    job_id = services.store.bulk.new_job_id(lambda: services.job_ids.new(reservation.client_id))
    fields = {
        "model": spec.key,
        RECEIVED_AT: received_at,
        "deadline_at": deadlines.deadline_at(received_at, deadline_ms),
        "options": options.for_model(),
        "media_type": media_type,
        "bytes": len(data),
        **({"owner": reservation.client_id} if reservation.client_id else {}),
        **({"callback_url": callback_url} if callback_url else {}),
    }
    answered = services.admission.admit(reservation, job_id, data, fields)
    if answered is not None:  # the cache's: the job is over already, stored as the 202 says
        (status, document), stored, timings = answered
        log.info("job answered from the cache", extra={"job_id": job_id, "model": spec.key, "status": status})
        if wait_s > 0:
            return _finished(services, job_id, spec)
        # The answer itself in the 202: a client need not poll (it may: the job is there, as said here).
        answer = (
            {"result": StoredJSON(document), "timings_ms": timings}
            if status == SUCCEEDED
            else {"error": json.loads(LATE_ERROR)}
        )
        return _accepted(job_id, spec, stored, status, answer)
    # An expensive decode counts against its key's share in flight (fairness by CPU cost, not by task).
    share = services.admission.decode_share
    charged = decode_charges.charge(share, settings, reservation.client_id, job_id, data, fields["deadline_at"])
    if charged:
        fields["decode_cost"] = charged
    # The key's own queue, as admitted (fairness). The job and its Celery task in one transaction: a Redis that
    # is down is a 503 for both, never half.
    queue = services.keys.preprocess_queue(spec.key, reservation.tenant)
    task = (services.keys.celery_queue(queue), services.task_messages.build(job_id, queue))
    # With wait: listening before the job exists, so an end that comes before the wait starts still wakes it.
    event = services.listener.register(job_id) if wait_s > 0 else None
    try:
        try:
            services.store.create(
                job_id,
                data,
                settings.jobs.upload_ttl_s,
                {**fields, SUBMITTED_AT: service_now(), "queue": queue},
                task=task,
                reserved=reservation.size,
            )
        except NotReplicated:
            services.admission.stored(reservation)  # the job held its bytes, and its withdrawal gave them back
            decode_charges.release(share, job_id, charged)
            raise
        except BaseException:
            decode_charges.release(share, job_id, charged)  # not queued: its charge goes with it
            raise
        services.admission.stored(reservation)
        log.info(
            "job accepted", extra={"job_id": job_id, "bytes": len(data), "media_type": media_type, "model": spec.key}
        )
        if event is None:
            return _accepted(job_id, spec, fields, QUEUED)
        try:
            waiting = cast(JobRecord, {"id": job_id, "status": QUEUED, **fields})
            record = until_ended(services.store, job_id, waiting, wait_s, event)
            record = expire_if_late(services.store, record)  # a wait ended by the deadline: over, one way or another
        except redis.RedisError:  # the job is stored: its 202 says where, whatever the wait met
            log.warning("a submission's wait lost Redis; answering 202", extra={"job_id": job_id})
            return _accepted(job_id, spec, fields, QUEUED)
    finally:
        if event is not None:
            services.listener.unregister(job_id, event)
    if record["status"] in TERMINAL:
        return _finished(services, job_id, spec, record)
    return _accepted(job_id, spec, fields, record["status"])


def _finished(
    services: Services, job_id: str, spec: ModelSpec, record: JobRecord | None = None
) -> tuple[Response, int, dict[str, str]]:
    """The 200 of a submission that waited and saw its job end: the job as a read answers it."""
    record = record or services.store.load(job_id)
    if record is None:  # gone already (a TTL of seconds): the 202 still tells where it was
        return _accepted(job_id, spec, {RECEIVED_AT: g.received_at}, QUEUED)
    try:
        services.store.confirm_durable()  # an end a failover could take back is not shown
    except redis.RedisError:  # AnswerNotReplicated, Unconfirmed: the job itself is stored; a 503 would hide its id
        return _accepted(job_id, spec, {RECEIVED_AT: record.get(RECEIVED_AT, g.received_at)}, QUEUED)
    metrics.SUBMITTED.labels(spec.name, spec.version).inc()
    return job_response(record), 200, {"Content-Location": url_for("jobs.get_job", job_id=job_id)}


def _accepted(
    job_id: str, spec: ModelSpec, fields: dict, status: str, answer: dict | None = None
) -> tuple[Response, int, dict[str, str]]:
    metrics.SUBMITTED.labels(spec.name, spec.version).inc()
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
    if wait_s <= 0 or not is_ours_to_ask(services, job_id):  # a made-up id's 404 holds no long-poll
        record = expire_if_late(services.store, load_owned(services, job_id))
    else:
        with services.holds.wait(g.get("client_id") or "", wait_s):  # counted: past a bound, 429 (or 503) at once
            # Listen before the first read: an end announced after it wakes this request.
            event = services.listener.register(job_id)
            try:
                record = until_ended(services.store, job_id, load_owned(services, job_id), wait_s, event)
            finally:
                services.listener.unregister(job_id, event)
        record = expire_if_late(services.store, record)
    if record["status"] in TERMINAL:
        services.store.confirm_durable()  # an end a failover could take back is not shown
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
    load_owned(services, job_id)
    cancelled = services.store.finish(
        job_id, CANCELLED, {"error": {"code": "cancelled", "message": "cancelled by the client"}}
    )
    record = services.store.load(job_id)
    if not cancelled or record is None:
        status = record["status"] if record else "gone"
        raise Problem(
            409,
            "job-already-finished",
            "Job already finished",
            f"job {job_id!r} ended as {status!r} and cannot be cancelled",
        )
    services.store.drop_upload(job_id)
    services.store.confirm_durable()  # a cancellation a failover could take back is not shown either
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
    record = load_owned(services, job_id)
    if not record.get("callback_url"):
        raise Problem(409, "no-callback", "No callback", f"job {job_id!r} was submitted without a callback_url")
    outcome = services.store.redeliver_callback(job_id)
    if not outcome:
        raise Problem(
            409,
            "job-not-finished",
            "Job not finished",
            f"job {job_id!r} has not ended: its callback is sent when it does",
        )
    if outcome == REDELIVER_QUEUED:
        log.info("callback queued again", extra={"job_id": job_id})
    return job_response(services.store.load(job_id) or record), 202
