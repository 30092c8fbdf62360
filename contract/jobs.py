"""Job records: their states, how each process moves them, and their JSON form.

A job is a Redis hash under `Keys.job(id)`. Moves are Lua scripts so that a
terminal state is final: whatever reaches a job first (its result, a
cancellation, an expiry) wins, and later writers change nothing.
"""
from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Mapping

import redis

from contract.keys import PREPROCESS_QUEUE, Keys

QUEUED = "queued"
PREPROCESSING = "preprocessing"
QUEUED_GPU = "queued_gpu"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
EXPIRED = "expired"
CANCELLED = "cancelled"
STATUSES = (QUEUED, PREPROCESSING, QUEUED_GPU, RUNNING, SUCCEEDED, FAILED, EXPIRED, CANCELLED)
TERMINAL = frozenset({SUCCEEDED, FAILED, EXPIRED, CANCELLED})

JSON_FIELDS = ("options", "result", "error", "timings", "batch", "callback")
STAMP_FIELDS = ("received_at", "submitted_at", "cpu_started_at", "decode_ms", "resize_ms", "pushed_at")

# KEYS[1] job hash; ARGV[1] max attempts (0: no limit), ARGV[2..] field, value, ...
# Returns 1 if moved, 0 if absent or terminal, -1 (unchanged) if requeued max attempts times.
_ADVANCE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'succeeded' or status == 'failed'
   or status == 'expired' or status == 'cancelled' then
  return 0
end
local limit = tonumber(ARGV[1])
if limit > 0 and tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0') >= limit then
  return -1
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""
MOVED, GONE, POISON = 1, 0, -1

# KEYS[1] job hash, KEYS[2] callback outbox; ARGV[1] ttl, ARGV[2] channel, ARGV[3] job id,
# ARGV[4..] field, value, ... A job with a callback_url enters the outbox in the same atomic
# step that ends it: once per terminal state, whoever ends it.
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'succeeded' or status == 'failed'
   or status == 'expired' or status == 'cancelled' then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
if redis.call('HEXISTS', KEYS[1], 'callback_url') == 1 then
  redis.call('HSET', KEYS[1], 'callback', '{"status":"pending","attempts":0,"last_error":null}')
  redis.call('RPUSH', KEYS[2], ARGV[3])
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""


# KEYS[1] job hash, KEYS[2] frame list, KEYS[3] upload; ARGV[1] max frames, ARGV[2] frame,
# ARGV[3..] field, value, ... Returns 1 pushed, 0 list full (nothing changed), -1 job gone or over.
_ENQUEUE_FRAME = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'succeeded' or status == 'failed'
   or status == 'expired' or status == 'cancelled' then
  redis.call('DEL', KEYS[3])
  return -1
end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('DEL', KEYS[3])
return 1
"""

PUSHED, LIST_FULL, JOB_OVER = 1, 0, -1


def new_job_id() -> str:
    return uuid.uuid4().hex


def utc_iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JobStore:
    """The job records in one Redis, under one namespace."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._advance = client.register_script(_ADVANCE)
        self._finish = client.register_script(_FINISH)
        self._enqueue_frame = client.register_script(_ENQUEUE_FRAME)

    def create(self, job_id: str, upload: bytes, upload_ttl_s: int, fields: Mapping[str, Any]) -> None:
        """Store the upload (claim check) and the record in one round trip."""
        record = {"id": job_id, "status": QUEUED, **_encode(fields)}
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.upload(job_id), upload, ex=upload_ttl_s)
        pipe.hset(self.keys.job(job_id), mapping=record)
        pipe.expire(self.keys.job(job_id), self.ttl_s)
        pipe.execute()

    def load(self, job_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(self.keys.job(job_id))
        return _decode(raw) if raw else None

    def delete(self, job_id: str) -> None:
        self.redis.delete(self.keys.job(job_id), self.keys.upload(job_id))

    def advance(self, job_id: str, status: str, fields: Mapping[str, Any] | None = None,
                client: Any = None) -> bool:
        """Move a live job to a non-terminal status; False when it is gone or already over."""
        return self.advance_unless_poisoned(job_id, status, 0, fields, client) == MOVED

    def advance_unless_poisoned(self, job_id: str, status: str, max_attempts: int,
                                fields: Mapping[str, Any] | None = None, client: Any = None) -> Any:
        """MOVED, GONE (absent or over) or POISON (requeued max_attempts times); in a pipeline,
        the reply comes with the pipeline's."""
        assert status not in TERMINAL, status
        args = [max_attempts, *_flatten({"status": status, "updated_at": time.time(), **(fields or {})})]
        return self._advance(keys=[self.keys.job(job_id)], args=args, client=client or self.redis)

    def finish(self, job_id: str, status: str, fields: Mapping[str, Any] | None = None,
               client: Any = None) -> bool:
        """End a job once; the first terminal state wins and wakes its long-polls."""
        assert status in TERMINAL, status
        values = {"status": status, "updated_at": time.time(), "finished_at": time.time(), **(fields or {})}
        args = [self.ttl_s, self.keys.job_events, job_id, *_flatten(values)]
        keys = [self.keys.job(job_id), self.keys.callback_outbox]
        return bool(self._finish(keys=keys, args=args, client=client or self.redis))

    def enqueue_frame(self, job_id: str, frame: bytes, max_frames: int, fields: Mapping[str, Any]) -> int:
        """Push a job's frame only if the list has room, marking it queued_gpu and dropping its
        upload in the same step: PUSHED, LIST_FULL (try again later) or JOB_OVER."""
        args = [max_frames, frame, *_flatten({"status": QUEUED_GPU, "updated_at": time.time(), **fields})]
        keys = [self.keys.job(job_id), self.keys.frames, self.keys.upload(job_id)]
        return int(self._enqueue_frame(keys=keys, args=args))

    def fail(self, job_id: str, code: str, message: str, client: Any = None) -> bool:
        return self.finish(job_id, FAILED, {"error": {"code": code, "message": message}}, client=client)


def queue_depths(client: redis.Redis, keys: Keys) -> dict[str, int]:
    """Jobs waiting for a CPU worker (Celery's list) and frames waiting for a GPU worker."""
    pipe = client.pipeline(transaction=False)
    pipe.llen(PREPROCESS_QUEUE)
    pipe.llen(keys.frames)
    preprocess, frames = pipe.execute()
    return {"preprocess": int(preprocess), "frames": int(frames)}


def _encode(fields: Mapping[str, Any]) -> dict[str, str]:
    return {name: _encode_value(value) for name, value in fields.items()}


def _encode_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _flatten(fields: Mapping[str, Any]) -> list[str]:
    flat: list[str] = []
    for name, value in fields.items():
        flat += [name, _encode_value(value)]
    return flat


def _decode(raw: Mapping[bytes, bytes]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for name_b, value_b in raw.items():
        name, value = name_b.decode(), value_b.decode()
        if name in JSON_FIELDS:
            record[name] = json.loads(value)
        elif name in STAMP_FIELDS or name in ("deadline_at", "updated_at", "finished_at"):
            record[name] = float(value)
        else:
            record[name] = value
    return record
