"""The public JSON documents of jobs: what the API answers about a job, what a callback POSTs, the options a
submission may carry and the problem document of every error (the service's own, health, models and stats:
contract.documents.status_documents).

One pydantic model per document. Responses are built through these models,
submissions are validated by them, and `app/openapi.py` generates the OpenAPI
document from them, so the description cannot drift from what is served.
Documents built from other processes' data ignore fields they do not name: a
newer GPU worker must not break an older API.

`status_documents` is the API's alone, yet lives here: its documents are public, stated by /openapi.json with
the job's, and reuse their models.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from typing_extensions import TypedDict

from contract.cache import CacheVerdict
from contract.callbacks import callback_document
from contract.jobs.record import STATUSES, utc_iso
from contract.jobs.timebill import FINISHED_AT, RECEIVED_AT, STAGE_DESCRIPTIONS, compute_time_bill
from contract.settings.models import MODEL_NAME_PATTERN

StatusName = Literal[STATUSES]  # type: ignore[valid-type]  # a contract.jobs.record.JobStatus, as JSON spells it
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
MaxDetections = Annotated[int, Field(ge=1, le=1000)]


class Document(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def to_json(self) -> dict[str, Any]:
        """The wire form; fields never set (an absent callback, an unset option) are left out."""
        return self.model_dump(mode="json", exclude_unset=True)


# --- a job ------------------------------------------------------------------------------------------


class Detection(Document):
    box: list[float] = Field(min_length=4, max_length=4, description="x1, y1, x2, y2 in the original image's pixels")
    score: Probability
    class_id: int = Field(ge=0)
    label: str


class ImageSize(Document):
    width: int = Field(ge=1)
    height: int = Field(ge=1)


class ModelRef(Document):
    name: str
    version: str


class JobResult(Document):
    detections: list[Detection]
    image: ImageSize = Field(description="the submitted image's size, after EXIF rotation")
    model: ModelRef


class JobError(Document):
    code: str = Field(
        description="decode_error, image_too_large, image_too_complex, deadline, cancelled, poison, "
        "inference_error, ..."
    )
    message: str


class JobOptions(TypedDict, total=False):
    """The options the GPU worker applies; unset ones fall back to the model's defaults."""

    conf: Probability
    iou: Probability
    max_det: MaxDetections


TimeBill = TypedDict(  # type: ignore[misc]
    "TimeBill",
    {stage: Annotated[float, Field(ge=0.0, description=text)] for stage, text in STAGE_DESCRIPTIONS.items()},
    total=False,
)
TimeBill.__doc__ = "Milliseconds per stage of this request; stages not reached yet are absent."


class ClosedBy(StrEnum):
    """Why a batch closed, as a job's `batch.closed_by` says."""

    FULL = "full"  # it reached the largest batch size
    WINDOW = "window"  # the batching window ran out first
    LATE = "late"  # its first frame had already waited a whole window on the list


class BatchInfo(Document):
    id: str = Field(description="worker id and batch sequence number")
    seq: int
    size: int = Field(ge=1, description="frames in the batch")
    index: int = Field(ge=0, description="this frame's place in the batch")
    closed_by: ClosedBy = Field(
        description="why the batch closed: full (the largest batch size), window (the "
        "window ran out), late (its first frame had already waited a window)"
    )
    worker: str


class CallbackState(Document):
    status: Literal["waiting", "pending", "delivering", "retrying", "delivered", "failed"] = Field(
        description="waiting: the job has not ended; pending: queued; delivering: an attempt is under way; "
        "retrying: the last attempt failed, the next is due at `next_attempt_at`; failed: given up "
        "(the dead letter: after callbacks.max_attempts or callbacks.retry_for_s, or a refused "
        "URL), redeliver it with POST /v1/jobs/{job_id}/callback"
    )
    attempts: int = Field(ge=0)
    last_error: str | None
    next_attempt_at: str | None = Field(None, json_schema_extra={"format": "date-time"}, description="while retrying")
    delivery_id: str | None = Field(
        None,
        description="what X-Imgserve-Delivery-Id carries: the same for every "
        "attempt of this job's callback, for the receiver's dedup",
    )


class Redelivered(Document):
    redelivered: int = Field(ge=0, description="callbacks queued again")


class JobDocument(Document):
    """A job, as `GET /v1/jobs/{job_id}` returns it and a callback POSTs it."""

    id: str
    status: StatusName
    model: ModelRef | None = Field(None, description="the model version the job was routed to")
    created_at: str | None = Field(json_schema_extra={"format": "date-time"})
    deadline_at: str | None = Field(
        None,
        json_schema_extra={"format": "date-time"},
        description="when it is over if it has not ended (created_at plus its deadline_ms): the service's clock",
    )
    finished_at: str | None = Field(
        None, json_schema_extra={"format": "date-time"}, description="when it ended: the service's clock"
    )
    options: JobOptions
    result: JobResult | None = Field(description="set once the job succeeded")
    error: JobError | None = Field(description="set once the job failed, expired or was cancelled")
    timings_ms: TimeBill
    batch: BatchInfo | None = Field(description="the GPU batch that answered the job")
    callback: CallbackState | None = Field(None, description="present when the job has a callback_url")
    cache: CacheVerdict | None = Field(
        None,
        description="hit: answered from the result cache (no CPU or GPU stage ran: timings_ms has receive "
        "and total only, and there is no batch); miss: looked up, computed, and cached if it "
        "succeeds; absent: the cache was off for it",
    )


def job_document(record: Mapping[str, Any]) -> dict[str, Any]:
    """The public JSON of a stored job record."""
    created = record.get(RECEIVED_AT)
    fields: dict[str, Any] = {
        "id": record["id"],
        "status": record.get("status"),
        **({"model": model_ref(record["model"])} if record.get("model") else {}),
        "created_at": utc_iso(created) if created is not None else None,
        "options": record.get("options") or {},
        "result": record.get("result"),
        "error": record.get("error"),
        # ended without the GPU worker's bill (failed, cancelled, expired): the stages its record's stamps span
        "timings_ms": record.get("timings") or (compute_time_bill(record) if record.get(FINISHED_AT) else {}),
        "batch": record.get("batch"),
    }
    deadline, finished = record.get("deadline_at"), record.get(FINISHED_AT)
    if deadline is not None:
        fields["deadline_at"] = utc_iso(deadline)
    if finished is not None:
        fields["finished_at"] = utc_iso(finished)
    if record.get("callback_url"):
        fields["callback"] = callback_document(record.get("callback"))
    if record.get("cache"):
        fields["cache"] = record["cache"]
    return JobDocument(**fields).to_json()


def model_ref(model_key: str) -> dict[str, str]:
    """name:version -> {name, version}."""
    name, _, version = model_key.partition(":")
    return {"name": name, "version": version}


class JobLinks(Document):
    self: str = Field(description="where to poll the job")


class JobAccepted(Document):
    id: str
    status: StatusName = Field(
        description="queued; with `wait`, where the job stands when the wait ended "
        "(it had not ended: a job that ends within it answers 200); "
        "succeeded: answered from the result cache (`cache` is hit), or "
        "expired: that answer came after `deadline_ms`; poll it as any job"
    )
    cache: CacheVerdict | None = Field(None, description="as the job document's")
    model: ModelRef = Field(description="the model version the job was routed to")
    created_at: str = Field(json_schema_extra={"format": "date-time"})
    links: JobLinks
    result: JobResult | None = Field(None, description="with cache: hit, the answer itself: no poll is needed")
    error: JobError | None = Field(None, description="with cache: hit and status expired, why")
    timings_ms: TimeBill = Field(None, description="with cache: hit, the job's time bill")


# --- a submission ------------------------------------------------------------------------------------

MODEL_REFERENCE_PATTERN = rf"^{MODEL_NAME_PATTERN}(:{MODEL_NAME_PATTERN})?$"  # name or name:version


class SubmitOptionsBase(Document):
    model: str = Field(
        None,
        max_length=129,
        pattern=MODEL_REFERENCE_PATTERN,
        description="name (routed to one of its versions as configured) or name:version (pinned); "
        "the deployment's default model when absent; 404 if nothing of that name is served",
    )
    conf: Probability = Field(None, description="confidence threshold; the model's default when absent")
    iou: Probability = Field(None, description="NMS IoU threshold; the model's default when absent")
    max_det: MaxDetections = Field(None, description="most detections returned")
    callback_url: str = Field(
        None,
        max_length=2048,
        pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^/?#\s\\@]+",
        json_schema_extra={"format": "uri"},
        description="http(s) URL that receives the job document, signed, once it ends; "
        "no user@, no backslash, no #; a host that resolves to a private "
        "address is refused (400)",
    )

    # Bounded by the deployment's deadline in submit_options_model(); declared here for its readers.
    deadline_ms: int = Field(None, ge=1, description="answer within this many ms or end `expired`")
    cache: bool = Field(
        None,
        description="false: neither answer from the result cache nor store this answer "
        "in it; default: as the deployment and the model configure it",
    )

    def for_model(self) -> JobOptions:
        options = JobOptions()
        if self.conf is not None:
            options["conf"] = self.conf
        if self.iou is not None:
            options["iou"] = self.iou
        if self.max_det is not None:
            options["max_det"] = self.max_det
        return options


@functools.lru_cache(maxsize=8)
def submit_options_model(max_deadline_ms: int, model_references: tuple[str, ...] = ()) -> type[SubmitOptionsBase]:
    """The submission options, with the deployment's deadline as deadline_ms's bound and, in the schema,
    the models it serves as `model`'s values (checked against the routing, not here: an unknown one is 404)."""
    fields: dict[str, Any] = {
        "deadline_ms": (
            int,
            Field(None, ge=1, le=max_deadline_ms, description="answer within this many ms or end `expired`"),
        )
    }
    if model_references:
        fields["model"] = (
            str,
            Field(
                None,
                max_length=129,
                pattern=MODEL_REFERENCE_PATTERN,
                json_schema_extra={"enum": list(model_references)},
                description=SubmitOptionsBase.model_fields["model"].description,
            ),
        )
    return create_model("SubmitOptions", __base__=SubmitOptionsBase, **fields)


@functools.lru_cache(maxsize=8)
def submit_query_model(max_deadline_ms: int, model_references: tuple[str, ...], max_wait_s: float) -> type[Document]:
    """A submission's query string: its options (submit_options_model), and `wait`, which only the query takes
    (it is about this request, not the job)."""
    return create_model(
        "SubmitQuery",
        __base__=submit_options_model(max_deadline_ms, model_references),
        wait=(
            float,
            Field(
                None,
                ge=0.0,
                le=max_wait_s,
                allow_inf_nan=False,
                description="one call: hold the request up to this many seconds "
                "until the job ends, and answer 200 with the finished "
                "job; 202 as without it if it has not ended by then",
            ),
        ),
    )


class WaitQueryBase(Document):
    wait: float = None  # bounded by the deployment's longest long-poll in wait_query_model()


@functools.lru_cache(maxsize=8)
def wait_query_model(max_wait_s: float) -> type[WaitQueryBase]:
    return create_model(
        "WaitQuery",
        __base__=WaitQueryBase,
        wait=(
            float,
            Field(
                None,
                ge=0.0,
                le=max_wait_s,
                allow_inf_nan=False,
                description="long-poll: hold the request up to this many seconds until the job ends",
            ),
        ),
    )


# --- errors -----------------------------------------------------------------------------------------


class InvalidParam(Document):
    name: str
    reason: str


PROBLEM_TYPE = "application/problem+json"  # the media type of every ProblemDocument


class ProblemDocument(Document):
    """RFC 9457 problem details: every API error has this shape."""

    type: str = Field(description="/problems/<slug>, e.g. /problems/overloaded")
    title: str
    status: int = Field(ge=400, le=599)
    detail: str
    invalid_params: list[InvalidParam] = Field(None, description="the request fields at fault")
    models: list[str] = Field(None, description="with model-not-found: the name:version of every model served")
