"""A job's record: its states, the hash it lies in, how its fields are encoded, and the moves that keep it live.

A job is a Redis hash under `Keys.job(id)`. Its moves are Redis functions (contract.library) so that a terminal
state is final: whatever reaches a job first (its result, a cancellation, an expiry) wins, and later writers change
nothing. How jobs end is contract.jobs.ending; `JobStore` here reads a record, deletes it, and moves live jobs
along (`advance_many`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypedDict, cast

import redis

from contract.jobs.timebill import FINISHED_AT, RECORD_STAMPS
from contract.library import Step
from contract.redis.clock import now as service_now
from contract.redis.keys import UPLOAD_SUFFIX, Keys
from contract.redis.shards import BulkPlane


class JobStatus(StrEnum):
    """A job's life, in order; the last four are terminal (the first to be written wins)."""

    QUEUED = "queued"  # stored, its task sent to the CPU workers
    PREPROCESSING = "preprocessing"  # a CPU worker claimed it
    QUEUED_GPU = "queued_gpu"  # its frame is on the GPU list
    RUNNING = "running"  # a GPU worker took it into a batch
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


QUEUED, PREPROCESSING, QUEUED_GPU, RUNNING = (
    JobStatus.QUEUED,
    JobStatus.PREPROCESSING,
    JobStatus.QUEUED_GPU,
    JobStatus.RUNNING,
)
SUCCEEDED, FAILED, EXPIRED, CANCELLED = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.EXPIRED, JobStatus.CANCELLED
STATUSES = tuple(JobStatus)
TERMINAL = frozenset({SUCCEEDED, FAILED, EXPIRED, CANCELLED})


class JobRecord(TypedDict, total=False):
    """A job's hash as the processes read it (`JobStore.load`): the fields each stage writes, decoded.
    Written by `create` (id .. owner, callback_url), the CPU worker (the stamps up to pushed_at), the GPU
    worker (result, timings, batch), whoever ends it (error, finished_at) and the callback worker."""

    id: str
    status: str  # a JobStatus value
    model: str  # name:version the API routed it to
    received_at: float
    submitted_at: float
    deadline_at: float
    updated_at: float
    finished_at: float
    options: dict[str, Any]  # conf, iou, max_det as the client gave them
    media_type: str
    bytes: str
    owner: str  # the API key's id, when keys are configured
    callback_url: str
    cpu_started_at: float
    claim: str  # the CPU worker's claim token: only its holder may push the frame
    queue: str  # the Celery queue its task went to: where a task lost in delivery is sent again
    resent: str  # how many times its task was sent again (tasks.hop.lost_deliveries)
    decode_ms: float
    resize_ms: float
    backpressure_ms: float
    pushed_at: float
    result: dict[str, Any] | StoredJSON  # StoredJSON from a store made with results_as_text
    timings: dict[str, float]
    batch: dict[str, Any]
    error: dict[str, str]  # code, message
    callback: dict[str, Any]  # status, attempts, last_error
    cache: str  # contract.cache's HIT or MISS; absent when the cache was off for the job
    cache_key: str  # a miss's digest: its result is cached under it if it succeeds
    result_ref: str  # a hit's digest: its result is the shared answer (Keys.hit_result), not a copy
    decode_cost: str  # bytes of decoding charged to its key until its CPU stage ends (contract.admission.decode_share)


JSON_FIELDS = ("options", "result", "error", "timings", "batch", "callback")


@dataclass(frozen=True)
class StoredJSON:
    """A JSON field kept as the text the hash holds: a reader that serves it as is never parses it, so a read
    costs the same whatever its size (a result is up to max_det's cap of detections)."""

    text: str


STAMP_FIELDS = RECORD_STAMPS

# The library's `advance_jobs` (contract/library/record.lua).
_ADVANCE = Step("advance_jobs")
MOVED, GONE, POISON = 1, 0, -1


JOB_ID_PATTERN = r"^[0-9a-f]{32}$"  # every job id's shape (contract.jobs.ids); anything else is no job of ours


def new_job_id() -> str:
    """An id of the format before checked ids (contract.jobs.ids, what the API issues): 32 hex digits, when it
    was issued (the service clock's milliseconds, 12 digits, the first 0) and 80 random bits. For records
    written straight into the store (tools, tests); the API reads such an id but never calls its job lost."""
    return f"{int(service_now() * 1000):012x}{secrets.token_hex(10)}"


def issued_at(job_id: str) -> float:
    """The moment `job_id` says it was issued (service clock, epoch seconds): digits 2-12 in both formats (the
    old one's first digit is 0 until the year 2527; a checked one's is its format)."""
    return int(job_id[1:12], 16) / 1000.0


def lost_at(job_id: str, ttl_s: int, now: float | None = None) -> float | None:
    """When a job whose record is missing was issued, if its record should still be there: a record lives
    at least `ttl_s` from its creation (its end renews it). None when the id is not ours, is older than that
    (expired, as records do) or is from the future. A margin of a minute keeps a record on the edge of its TTL
    out. Only for an id that passed its check (contract.jobs.ids): the moment alone proves nothing."""
    if not is_job_id(job_id):
        return None
    issued, now = issued_at(job_id), service_now() if now is None else now
    return issued if now - (ttl_s - LOST_MARGIN_S) <= issued <= now + LOST_MARGIN_S else None


LOST_MARGIN_S = 60


def is_job_id(text: str) -> bool:
    return re.fullmatch(JOB_ID_PATTERN[1:-1], text) is not None


# The last moment an ISO date can name (9999-12-31T23:59:59Z): a stored moment past it (a test's "never", a
# hand-edited record) is shown as it, one before 1970 or not a number as 1970: never a 500 on the read or a
# callback that can never be built.
LAST_ISO_MOMENT = 253402300799.0


def utc_iso(epoch: float) -> str:
    moment = min(epoch, LAST_ISO_MOMENT) if epoch >= 0 else 0.0  # NaN compares False: 1970
    return datetime.fromtimestamp(moment, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JobStore:
    """The job records in one Redis, under one namespace (with bulk shards, their uploads on the shards)."""

    def __init__(
        self, client: redis.Redis, keys: Keys, ttl_s: int, bulk: BulkPlane | None = None, results_as_text: bool = False
    ) -> None:
        """`ttl_s`: how long a record stays once ended. `bulk`: where uploads and frames lie (contract.redis.shards);
        None: in `client`'s Redis. `results_as_text`: `load` leaves a result as its StoredJSON (the API serves it
        as stored)."""
        self.redis = client
        self.as_text = ("result",) if results_as_text else ()
        self.bulk = bulk or BulkPlane(client)
        self.keys = keys
        self.job_prefix = keys.job_prefix  # a job's keys named here, the id not handed on (Keys.job_prefix)
        self.ttl_s = ttl_s

    def load(self, job_id: str) -> JobRecord | None:
        """A job's record; a cache hit's that succeeded with its result read from the answer it refers to (one
        GET more: contract.jobs.hits). That answer outlives every record that refers to it."""
        raw: dict[bytes, bytes] = self.redis.hgetall(self.job_prefix + job_id)  # type: ignore[assignment]
        if not raw:
            return None
        digest = raw.get(b"result_ref")
        if digest is not None and b"result" not in raw and raw.get(b"status") == SUCCEEDED.encode():
            answer = self.redis.get(self.keys.hit_result(digest.decode()))
            if answer is not None:
                raw[b"result"] = answer  # type: ignore[assignment]
        return decode_record(raw, self.as_text)

    def delete(self, job_id: str) -> None:
        job_key = self.job_prefix + job_id
        self.redis.delete(job_key, job_key + UPLOAD_SUFFIX)
        if self.bulk.sharded:
            self._delete_quietly(job_key + UPLOAD_SUFFIX, self.bulk.client_for(job_id))

    def drop_upload(self, job_id: str) -> None:
        """The upload of a job that ended before its frame was pushed (a cancellation): gone now rather than at
        its TTL. (Whatever ends a job drops the upload's marker with it; a shard's bytes are this call's.)"""
        shard = self.bulk.client_for(job_id) if self.bulk.sharded else None
        self.drop_upload_at(self.job_prefix + job_id + UPLOAD_SUFFIX, shard)

    def drop_upload_at(self, upload_key: str, shard: redis.Redis | None) -> None:
        """drop_upload of the upload at `upload_key`, for a facade that names its jobs' keys itself; its bytes on
        `shard` too (the job's, with bulk shards: bulk.client_for)."""
        self._delete_quietly(upload_key)
        if shard is not None:
            self._delete_quietly(upload_key, shard)

    def advance_many(
        self,
        job_ids: Sequence[str],
        status: str,
        max_attempts: int,
        fields: Mapping[str, Any] | None = None,
        client: Any = None,
    ) -> Any:
        """Per job MOVED, GONE (absent or over) or POISON (requeued max_attempts times), in one
        step; in a pipeline, the reply comes with the pipeline's."""
        assert status not in TERMINAL, status
        args: list[Any] = [
            max_attempts,
            *flatten_fields({"status": status, "updated_at": service_now(), **(fields or {})}),
        ]
        return _ADVANCE(client or self.redis, [self.job_prefix + job_id for job_id in job_ids], args)

    def _delete_quietly(self, key: str, client: redis.Redis | None = None) -> None:
        try:
            (client or self.redis).delete(key)
        except redis.RedisError:
            pass


def encode_fields(fields: Mapping[str, Any]) -> dict[str, str]:
    """Fields as a job hash holds them: dicts and lists as compact JSON, the rest as text."""
    return {name: encode_value(value) for name, value in fields.items()}


_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder, not one per value


def encode_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return _COMPACT_JSON.encode(value)
    return str(value)


def flatten_fields(fields: Mapping[str, Any]) -> list[str]:
    """encode_fields as HSET's arguments: name, value, name, value, ..."""
    flat: list[str] = []
    for name, value in fields.items():
        flat += [name, encode_value(value)]
    return flat


def decode_record(raw: Mapping[Any, Any], as_text: Sequence[str] = ()) -> JobRecord:
    """A job hash as redis-py returns it (bytes names and values) -> its record; the JSON fields named in
    `as_text` as their StoredJSON, unparsed."""
    record: dict[str, Any] = {}
    for name_b, value_b in raw.items():
        name, value = name_b.decode(), value_b.decode()
        if name in as_text:
            record[name] = StoredJSON(value)
        elif name in JSON_FIELDS:
            record[name] = json.loads(value)
        elif name in STAMP_FIELDS or name in ("deadline_at", "updated_at", FINISHED_AT):
            record[name] = float(value)
        else:
            record[name] = value
    return cast(JobRecord, record)
