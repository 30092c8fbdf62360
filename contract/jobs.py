"""Job records: their states, how each process moves them, and their JSON form.

A job is a Redis hash under `Keys.job(id)`. Moves are Lua scripts so that a
terminal state is final: whatever reaches a job first (its result, a
cancellation, an expiry) wins, and later writers change nothing.
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, NamedTuple, TypedDict, cast

import redis

from contract import budget
from contract.budget import RELEASE_LUA
from contract.cache import REMEMBER_LUA, CacheLimits
from contract.connection import NotReplicated, execute_and_wait
from contract.keys import UPLOAD_SUFFIX, Keys
from contract.replies import PayloadReader
from contract.shards import SHARD_ERRORS, SHARDED_UPLOAD, BulkPlane, ShardUnavailable


class JobStatus(StrEnum):
    """A job's life, in order; the last four are terminal (the first to be written wins)."""
    QUEUED = "queued"                 # stored, its task sent to the CPU workers
    PREPROCESSING = "preprocessing"   # a CPU worker claimed it
    QUEUED_GPU = "queued_gpu"         # its frame is on the GPU list
    RUNNING = "running"               # a GPU worker took it into a batch
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


QUEUED, PREPROCESSING, QUEUED_GPU, RUNNING = (JobStatus.QUEUED, JobStatus.PREPROCESSING, JobStatus.QUEUED_GPU,
                                             JobStatus.RUNNING)
SUCCEEDED, FAILED, EXPIRED, CANCELLED = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.EXPIRED, JobStatus.CANCELLED
STATUSES = tuple(JobStatus)
TERMINAL = frozenset({SUCCEEDED, FAILED, EXPIRED, CANCELLED})

class JobRecord(TypedDict, total=False):
    """A job's hash as the processes read it (`JobStore.load`): the fields each stage writes, decoded.
    Written by `create` (id .. owner, callback_url), the CPU worker (the stamps up to pushed_at), the GPU
    worker (result, timings, batch), whoever ends it (error, finished_at) and the callback worker."""
    id: str
    status: str                    # a JobStatus value
    model: str                     # name:version the API routed it to (absent on jobs from before models)
    received_at: float
    submitted_at: float
    deadline_at: float
    updated_at: float
    finished_at: float
    options: dict[str, Any]        # conf, iou, max_det as the client gave them
    media_type: str
    bytes: str
    owner: str                     # the API key's id, when keys are configured
    callback_url: str
    cpu_started_at: float
    claim: str                     # the CPU worker's claim token: only its holder may push the frame
    decode_ms: float
    resize_ms: float
    backpressure_ms: float
    pushed_at: float
    result: dict[str, Any]
    timings: dict[str, float]
    batch: dict[str, Any]
    error: dict[str, str]          # code, message
    callback: dict[str, Any]       # status, attempts, last_error
    cache: str                     # contract.cache's HIT or MISS; absent when the cache was off for the job
    cache_key: str                 # a miss's digest: its result is cached under it if it succeeds


JSON_FIELDS = ("options", "result", "error", "timings", "batch", "callback")
STAMP_FIELDS = ("received_at", "submitted_at", "cpu_started_at", "decode_ms", "resize_ms", "backpressure_ms",
                "pushed_at")

# The terminal states as a Lua set, rendered from TERMINAL so the scripts cannot drift from it.
_LUA_TERMINAL = "local TERMINAL = {" + ", ".join(f"{status.value} = true" for status in sorted(TERMINAL)) + "}\n"

# KEYS job hashes; ARGV[1] max attempts (0: no limit), ARGV[2..] field, value, ... (the same for each job).
# Per job: 1 if moved, 0 if absent or terminal, -1 (unchanged) if requeued max attempts times.
_ADVANCE = _LUA_TERMINAL + """
local limit = tonumber(ARGV[1])
local verdicts = {}
for i, key in ipairs(KEYS) do
  local status = redis.call('HGET', key, 'status')
  if not status or TERMINAL[status] then
    verdicts[i] = 0
  elseif limit > 0 and tonumber(redis.call('HGET', key, 'attempts') or '0') >= limit then
    verdicts[i] = -1
  else
    redis.call('HSET', key, unpack(ARGV, 2))
    verdicts[i] = 1
  end
end
return verdicts
"""
MOVED, GONE, POISON = 1, 0, -1

# A callback queued: what the step that ends a job (or a redelivery) writes as its state.
log = logging.getLogger(__name__)

PENDING_CALLBACK = '{"status":"pending","attempts":0,"last_error":null}'

# What a job answered after its deadline carries instead of its result (the answer came too late to stand).
LATE_ERROR = '{"code":"deadline","message":"expired: its answer came after the deadline"}'

FINISH_NAMES = 7   # how many arguments JobStore.finish_names() gives: scripts find theirs after them

# A Lua function that ends each live job whose hash is in KEYS[first_key..], with its arguments from
# ARGV[at..]: per job its id, the count of field and value arguments, the fields and values (the
# first terminal state wins). A job with a callback_url enters the outbox in the same atomic step
# that ends it: once per terminal state, whoever ends it. An answer written after the job's deadline
# does not stand: the job ends `expired` instead (its result is dropped; a long-poll was told at the
# deadline). The job leaves the deadline index (`deadlines`, a sorted set) in the same step, and a job that
# succeeded with a `cache_key` leaves its result in the result cache (contract.cache). Returns how many jobs it
# ended. Scripts that end jobs among other work (the GPU worker's batch write) start with it.
FINISH_JOBS_LUA = _LUA_TERMINAL + RELEASE_LUA + REMEMBER_LUA + f"""local UPLOAD_SUFFIX = '{UPLOAD_SUFFIX}'
local PENDING_CALLBACK = '{PENDING_CALLBACK}'
local LATE_ERROR = '{LATE_ERROR}'
local SUCCEEDED, EXPIRED = '{JobStatus.SUCCEEDED.value}', '{JobStatus.EXPIRED.value}'
""" + """
local function late_as_expired(key, fields)
  local status, finished, result
  for i = 1, #fields, 2 do
    if fields[i] == 'status' then status = i elseif fields[i] == 'finished_at' then finished = i
    elseif fields[i] == 'result' then result = i end
  end
  local deadline = tonumber(redis.call('HGET', key, 'deadline_at'))
  if not status or fields[status + 1] ~= SUCCEEDED or not deadline or not finished
      or tonumber(fields[finished + 1]) <= deadline then
    return fields
  end
  local kept = {}
  for i = 1, #fields, 2 do
    if i ~= result then
      kept[#kept + 1] = fields[i]
      kept[#kept + 1] = (i == status) and EXPIRED or fields[i + 1]
    end
  end
  kept[#kept + 1] = 'error'
  kept[#kept + 1] = LATE_ERROR
  return kept
end

-- The names finish_jobs needs, from the FINISH_NAMES arguments at ARGV[i..] (JobStore.finish_names).
local function finish_names(outbox, i)
  return {outbox = outbox, ttl = tonumber(ARGV[i]), channel = ARGV[i + 1], deadlines = ARGV[i + 2],
          waiting = ARGV[i + 3], cache = cache_names(i + 4)}
end

local function finish_jobs(names, first_key, at)
  local ended = 0
  for k = first_key, #KEYS do
    local key, job_id, count = KEYS[k], ARGV[at], tonumber(ARGV[at + 1])
    local status = redis.call('HGET', key, 'status')
    if status and not TERMINAL[status] then
      redis.call('HSET', key, unpack(late_as_expired(key, {unpack(ARGV, at + 2, at + 1 + count)})))
      redis.call('EXPIRE', key, names.ttl)
      remember(names.cache, key, SUCCEEDED)
      if redis.call('DEL', key .. UPLOAD_SUFFIX) == 1 then   -- whatever ended it, its upload goes with it
        release_waiting(names.waiting, redis.call('HGET', key, 'model'), redis.call('HGET', key, 'bytes'))
      end
      redis.call('ZREM', names.deadlines, job_id)
      if redis.call('HEXISTS', key, 'callback_url') == 1 then
        redis.call('HSET', key, 'callback', PENDING_CALLBACK)
        redis.call('RPUSH', names.outbox, job_id)
        redis.call('PUBLISH', names.outbox, job_id)   -- wakes the callback relays (a channel of the same name)
      end
      redis.call('PUBLISH', names.channel, job_id)
      ended = ended + 1
    end
    at = at + 2 + count
  end
  return ended
end
"""

# KEYS[1] callback outbox, KEYS[2..] job hashes; ARGV[1..FINISH_NAMES] JobStore.finish_names(), then the jobs'.
_FINISH = FINISH_JOBS_LUA + f"return finish_jobs(finish_names(KEYS[1], 1), 2, {FINISH_NAMES + 1})\n"


# A result-cache lookup (contract.cache) and, on a miss, the job's admission (contract.budget's admit), in one
# round trip. On a hit: the entry's TTL and last use renewed, the hit counted, the record written with the cached
# document as its result, then ended `succeeded` as any job is (finish_jobs: long-polls woken, callback queued);
# no admission (a hit adds nothing to wait). On a miss: the miss counted, then admit(). KEYS[1] callback outbox,
# KEYS[2] the entry, KEYS[3] the LRU set, KEYS[4] the stats hash, KEYS[5..4+M] admit()'s keys, KEYS[5+M] the job
# hash; ARGV[1..FINISH_NAMES] finish_names(), then the digest, now, the cache TTL, the model, M, admit()'s
# ADMISSION_ARGS arguments, the count of record field and value arguments, the record's, and the job's end
# (finish_arguments). Returns {'hit', status, document} on a hit (status `expired` when the hit came after the
# job's deadline: finish_jobs ends it so, and the result is not stored, as for any late answer), admit()'s
# verdict on a miss.
_ANSWER_OR_ADMIT = FINISH_JOBS_LUA + budget.ADMIT_LUA + f"local N, A = {FINISH_NAMES}, {budget.ADMISSION_ARGS}\n" + """
local digest, now, ttl, model = ARGV[N + 1], ARGV[N + 2], ARGV[N + 3], ARGV[N + 4]
local admission_keys = tonumber(ARGV[N + 5])
local job = 5 + admission_keys
local document = redis.call('GET', KEYS[2])
if not document then
  redis.call('HINCRBY', KEYS[4], model .. ':misses', 1)
  return admit(5, job - 1, N + 6)
end
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[3], 'XX', now, digest)
redis.call('HINCRBY', KEYS[4], model .. ':hits', 1)
local names = finish_names(KEYS[1], 1)
local at = N + 6 + A
local count = tonumber(ARGV[at])
redis.call('HSET', KEYS[job], unpack(ARGV, at + 1, at + count))
redis.call('EXPIRE', KEYS[job], names.ttl)
finish_jobs(names, job, at + 1 + count)
local status = redis.call('HGET', KEYS[job], 'status')
if status == SUCCEEDED then   -- in time: the cached answer is its result
  redis.call('HSET', KEYS[job], 'result', document)
end                           -- else answered after its deadline: expired as any late answer, without it
return {'hit', status, document}
"""

class Replication(NamedTuple):
    """How many replicas a new job must reach (Redis WAIT) before the API says 202, and for how long it waits
    (settings.redis: replicas_per_write, replica_timeout_ms). 0: no wait."""
    replicas: int = 0
    timeout_ms: int = 1000


NO_REPLICATION = Replication()


class CacheHit(NamedTuple):
    """A submission the result cache answered (JobStore.answer_or_admit): how its job ended, and the cached
    result document (JSON text), which the job holds only if it ended `succeeded`."""
    status: str
    document: str

# A job's callback queued again from its first attempt. KEYS[1] job hash, KEYS[2] the outbox, KEYS[3] the
# scheduled set, KEYS[4] the dead set; ARGV[1] the job id. 1 queued, 0 not (no such job, not ended, no callback).
_REDELIVER_CALLBACK = _LUA_TERMINAL + f"""
local status = redis.call('HGET', KEYS[1], 'status')
if not status or not TERMINAL[status] or redis.call('HEXISTS', KEYS[1], 'callback_url') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'callback', '{PENDING_CALLBACK}')
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('PUBLISH', KEYS[2], ARGV[1])
return 1
"""

# A CPU worker's claim, in one round trip instead of three (read, move, fetch the upload): this step,
# pipelined after a plain GET of the upload, whose reply is read straight into one buffer
# (contract.replies). (The upload stays out of the script: Lua would copy 0.8 MB in and out of its own
# memory, which cost Redis 1.5 ms of CPU per image.)
# KEYS[1] job hash; ARGV[1] now, ARGV[2] the claim (a token of this attempt, which its push must show).
# Returns {verdict, record fields...}: 'claimed' (now preprocessing), 'missing', 'over' (past this stage or
# ended), 'late' (deadline passed, unchanged: the caller ends it).
_CLAIM = f"""
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {{'missing'}} end
if status ~= '{QUEUED.value}' and status ~= '{PREPROCESSING.value}' then return {{'over', 'status', status}} end
local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline_at'))
if deadline and tonumber(ARGV[1]) > deadline then return {{'late'}} end
redis.call('HSET', KEYS[1], 'status', '{PREPROCESSING.value}', 'cpu_started_at', ARGV[1], 'updated_at', ARGV[1],
           'claim', ARGV[2])
local reply = redis.call('HGETALL', KEYS[1])
table.insert(reply, 1, 'claimed')
return reply
"""


LARGE_UPLOAD_BYTES = 2 * 1024 * 1024   # a connection that carried a larger upload is closed after it

JOB_ID_PATTERN = r"^[0-9a-f]{32}$"   # what new_job_id() makes; anything else is no job of ours


def new_job_id() -> str:
    return uuid.uuid4().hex


def is_job_id(text: str) -> bool:
    return re.fullmatch(JOB_ID_PATTERN[1:-1], text) is not None


def utc_iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JobStore:
    """The job records in one Redis, under one namespace."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int, uploads: redis.Redis | None = None,
                 cache: CacheLimits | None = None, bulk: BulkPlane | None = None,
                 replication: Replication = NO_REPLICATION) -> None:
        """`uploads`: the client uploads are written with (the API's: a few connections, see `create`).
        `cache`: where jobs this store ends `succeeded` leave their results (the GPU worker's); None: nowhere.
        `bulk`: where uploads and frames lie (contract.shards); None: in `client`'s Redis.
        `replication`: how many replicas a new job must reach before `create` (or a cache hit) returns (the API's)."""
        self.replication = replication
        self.redis = client
        self.uploads = uploads or client
        self.bulk = bulk or BulkPlane(client)
        self.keys = keys
        self.ttl_s = ttl_s
        self.cache = cache or CacheLimits(keys.cache_prefix)
        self._advance = client.register_script(_ADVANCE)
        self._finish = client.register_script(_FINISH)
        self._claim = client.register_script(_CLAIM)
        self._redeliver = client.register_script(_REDELIVER_CALLBACK)
        self._answer_or_admit = client.register_script(_ANSWER_OR_ADMIT)
        self._payloads: PayloadReader | None = None   # the CPU worker's: uploads read in one copy
        self._shard_payloads: dict[int, PayloadReader] = {}

    def create(self, job_id: str, upload: bytes, upload_ttl_s: int, fields: Mapping[str, Any],
               task: tuple[str, bytes] | None = None, reserved: int = 0) -> None:
        """Store the upload (claim check), then the record and `task` (a queue's list key, the message for it)
        in one transaction: no job without its task or task without its job.
        `reserved`: the bytes admitted for it (contract.budget); what the upload does not use is given back."""
        record: dict[Any, Any] = {"id": job_id, "status": QUEUED, **_encode(fields)}
        upload_key = self.keys.upload(job_id)
        pipe = self.redis.pipeline(transaction=True)
        if self.bulk.sharded:
            shard = self.bulk.index(job_id)
            try:
                self._write_upload(self.bulk.clients[shard], upload_key, upload_ttl_s, upload)
            except SHARD_ERRORS as exc:
                self.bulk.mark_down(shard)
                raise ShardUnavailable(shard, exc) from exc
            pipe.set(upload_key, SHARDED_UPLOAD, ex=upload_ttl_s)
        else:
            self._write_upload(self.uploads, upload_key, upload_ttl_s, upload)
        unused = reserved - len(upload)
        if reserved and unused > 0:   # a multipart body's own bytes around the image
            for field in (str(fields.get("model", "")), budget.ALL):
                if field:
                    pipe.hincrby(self.keys.waiting_bytes, field, -unused)
        pipe.hset(self.keys.job(job_id), mapping=record)
        pipe.expire(self.keys.job(job_id), self.ttl_s)
        if "deadline_at" in fields:   # the sweeper ends it there if nothing else has (expire_overdue)
            pipe.zadd(self.keys.deadlines, {job_id: float(fields["deadline_at"])})
        if task is not None:
            pipe.lpush(*task)
        try:
            if self.replication.replicas:
                # WAIT after the transaction, on its connection: the upload, written before it, is acknowledged
                # with it (a replica's offset covers everything the primary wrote before). The transaction also
                # looks for the upload: written to a primary that a failover replaced since, it is not there.
                replies, acknowledged = execute_and_wait(
                    self.redis, [("MULTI",), *(args for args, _ in pipe.command_stack), ("EXISTS", upload_key),
                                 ("EXEC",)], self.replication.replicas, self.replication.timeout_ms)
                if acknowledged < self.replication.replicas or not replies[-1][-1]:
                    raise NotReplicated(acknowledged if replies[-1][-1] else 0, self.replication.replicas)
            else:
                pipe.execute()
        except NotReplicated:
            self.withdraw(job_id)
            raise
        except redis.RedisError:
            self._delete_quietly(upload_key)   # no job holds it: it would wait for its TTL
            if self.bulk.sharded:
                self._delete_quietly(upload_key, self.bulk.client_for(job_id))
            raise

    def withdraw(self, job_id: str) -> None:
        """A job stored on the primary that too few replicas acknowledged: its submitter is told 503 (retry), so
        it ends here and no worker spends anything on it. Quietly: Redis may be going away as well."""
        try:
            self.finish(job_id, FAILED, {"error": {"code": "not_replicated", "message": "stored on too few "
                                                    "replicas in time; the submission was refused (503)"}})
        except redis.RedisError:
            log.warning("could not withdraw job %s, stored on too few replicas", job_id)

    def answer_or_admit(self, job_id: str, fields: Mapping[str, Any], digest: str, cache_ttl_s: int,
                        timings: Mapping[str, float],
                        admission: budget.AdmissionRequest) -> CacheHit | budget.Admission:
        """One step for a job the result cache may answer. On a hit for `digest`: the job stored over already,
        with the cached result and `timings`, ended as any job ends (long-polls, callback); (its status, the
        result document as JSON text). The status is `expired`, without the result stored, when the hit came
        after the job's deadline (deadline_ms shorter than the lookup). On a miss: the budgets' verdict on
        `admission` (its bytes reserved when admitted), nothing stored. A hit needs no admission: it adds
        nothing to wait. See _ANSWER_OR_ADMIT."""
        record = _flatten({"id": job_id, "status": QUEUED, **fields})
        job_keys, job_args = self.finish_arguments([(job_id, SUCCEEDED, {"timings": timings})])
        admission_keys, admission_args = budget.admission_arguments(self.keys, admission)
        keys = [self.keys.callback_outbox, self.keys.cache_entry(digest), self.keys.cache_lru, self.keys.cache_stats,
                *admission_keys, *job_keys]
        args = [*self.finish_names(), digest, repr(time.time()), cache_ttl_s, admission.model_key,
                len(admission_keys), *admission_args, len(record), *record, *job_args]
        if self.replication.replicas:   # a hit is a new job, answered: on its replicas before the 202 says so
            reply, acknowledged = self._script_and_wait(self._answer_or_admit, keys, args)
            if reply[0] == b"hit" and acknowledged < self.replication.replicas:
                raise NotReplicated(acknowledged, self.replication.replicas)   # (a miss waits at `create`)
        else:
            reply = self._answer_or_admit(keys=keys, args=args)
        if reply[0] == b"hit":
            return CacheHit(bytes(reply[1]).decode(), bytes(reply[2]).decode())
        return budget.Admission.of(reply)

    def _script_and_wait(self, script: Any, keys: list[Any], args: list[Any]) -> tuple[Any, int]:
        """A registered script's EVALSHA, then WAIT on its connection (execute_and_wait): (its reply, replicas
        that acknowledged). Loaded first when the server does not know it (a new primary, a restart)."""
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            replies, acknowledged = execute_and_wait(self.redis, [command], self.replication.replicas,
                                                     self.replication.timeout_ms)
        except redis.exceptions.NoScriptError:
            self.redis.script_load(script.script)
            replies, acknowledged = execute_and_wait(self.redis, [command], self.replication.replicas,
                                                     self.replication.timeout_ms)
        return replies[0], acknowledged

    def _write_upload(self, client: redis.Redis, key: str, ttl_s: int, upload: bytes) -> None:
        """The upload alone on the wire and last in its command (SETEX key ttl value): Redis then keeps the
        buffer it read the value into as the value (followed by anything, SET's own EX or the transaction's
        next command, it copies it). Redis also gives that connection a new buffer the upload's size, and keeps
        it while the connection stays busy: so uploads go over few connections (the API's `uploads` client),
        and one that carried an upload over LARGE_UPLOAD_BYTES is closed after it."""
        if len(upload) <= LARGE_UPLOAD_BYTES:
            client.execute_command("SETEX", key, ttl_s, upload)   # type: ignore[no-untyped-call]  # setex() warns
            return
        pool = client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_command("SETEX", key, ttl_s, upload)  # type: ignore[no-untyped-call]
            reply = connection.read_response()
            if isinstance(reply, redis.ResponseError):
                raise reply
        finally:
            connection.disconnect()  # type: ignore[no-untyped-call]  # redis-py's untyped method
            pool.release(connection)

    def _delete_quietly(self, key: str, client: redis.Redis | None = None) -> None:
        try:
            (client or self.redis).delete(key)
        except redis.RedisError:
            pass

    def load(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hgetall(self.keys.job(job_id))
        return _decode(raw) if raw else None

    def delete(self, job_id: str) -> None:
        self.redis.delete(self.keys.job(job_id), self.keys.upload(job_id))
        if self.bulk.sharded:
            self._delete_quietly(self.keys.upload(job_id), self.bulk.client_for(job_id))

    def drop_upload(self, job_id: str) -> None:
        """The upload of a job that ended before its frame was pushed (a cancellation): gone now rather than at
        its TTL. (Whatever ends a job drops the upload's marker with it; a shard's bytes are this call's.)"""
        self._delete_quietly(self.keys.upload(job_id))
        if self.bulk.sharded:
            self._delete_quietly(self.keys.upload(job_id), self.bulk.client_for(job_id))

    def advance_many(self, job_ids: Sequence[str], status: str, max_attempts: int,
                     fields: Mapping[str, Any] | None = None, client: Any = None) -> Any:
        """Per job MOVED, GONE (absent or over) or POISON (requeued max_attempts times), in one
        step; in a pipeline, the reply comes with the pipeline's."""
        assert status not in TERMINAL, status
        args: list[Any] = [max_attempts, *_flatten({"status": status, "updated_at": time.time(), **(fields or {})})]
        return self._advance(keys=[self.keys.job(job_id) for job_id in job_ids], args=args,
                             client=client or self.redis)

    def finish(self, job_id: str, status: str, fields: Mapping[str, Any] | None = None,
               client: Any = None) -> bool:
        """End a job once; the first terminal state wins and wakes its long-polls."""
        return bool(self.finish_many([(job_id, status, fields or {})], client))

    def finish_many(self, outcomes: Sequence[tuple[str, str, Mapping[str, Any]]], client: Any = None) -> Any:
        """End each (job id, terminal status, fields) that is still live, in one step: how many it
        ended (in a pipeline, with the pipeline's replies)."""
        job_keys, job_args = self.finish_arguments(outcomes)
        return self._finish(keys=[self.keys.callback_outbox, *job_keys], args=[*self.finish_names(), *job_args],
                            client=client or self.redis)

    def finish_names(self) -> list[Any]:
        """What FINISH_JOBS_LUA's finish_names() reads (FINISH_NAMES of them): the record TTL, the job-events
        channel, the deadline index, the waiting-bytes hash and the result cache's names."""
        names = [self.ttl_s, self.keys.job_events, self.keys.deadlines, self.keys.waiting_bytes,
                 *self.cache.finish_names()]
        assert len(names) == FINISH_NAMES
        return names

    def finish_arguments(self, outcomes: Sequence[tuple[str, str, Mapping[str, Any]]]) -> tuple[list[str], list[Any]]:
        """The job keys and the arguments FINISH_JOBS_LUA's finish_jobs() reads, for these outcomes."""
        now = time.time()
        keys: list[str] = []
        args: list[Any] = []
        for job_id, status, fields in outcomes:
            assert status in TERMINAL, status
            flat = _flatten({"status": status, "updated_at": now, "finished_at": now, **fields})
            keys.append(self.keys.job(job_id))
            args += [job_id, len(flat), *flat]
        return keys, args

    def claim_for_preprocessing(self, job_id: str, now: float, claim: str = "") -> tuple[str, memoryview | None,
                                                                                        JobRecord]:
        """A CPU worker takes a queued job as `claim` (its push must show it): (verdict, upload, record) in one
        round trip; see _CLAIM.
        A claimed job whose upload expired comes back with `upload` None. (The upload is read before
        the claim, in the same round trip: a job past this stage has no upload left to read.)"""
        if self.bulk.sharded:
            return self._claim_from_shard(job_id, now, claim)
        if self._payloads is None:
            self._payloads = PayloadReader(self.redis)
        commands = (("GET", self.keys.upload(job_id)),
                    ("EVALSHA", self._claim.sha, 1, self.keys.job(job_id), repr(now), claim))
        reconnected = reloaded = False
        while True:
            try:
                upload, reply = self._payloads.execute(*commands)
            except redis.ConnectionError:
                # A connection Redis dropped (it restarted) fails on its first use: once more on a new one, as
                # redis-py's own client does. Both steps may run twice: a claim may be claimed again.
                if reconnected:
                    raise
                reconnected = True
                continue
            if isinstance(reply, redis.ResponseError) and str(reply).startswith("NOSCRIPT") and not reloaded:
                self.redis.script_load(_CLAIM)   # a restarted Redis forgot it: load it, try again
                reloaded = True
                continue
            for answer in (upload, reply):
                if isinstance(answer, redis.ResponseError):
                    raise answer
            break
        verdict, fields = reply[0].decode(), reply[1:]
        record = _decode(dict(zip(fields[::2], fields[1::2])))
        return verdict, (upload if verdict == "claimed" else None), record

    def _claim_from_shard(self, job_id: str, now: float, claim: str) -> tuple[str, memoryview | None, JobRecord]:
        """claim_for_preprocessing with bulk shards: the claim on the control plane, then, if claimed, the
        upload from the job's shard (ShardUnavailable when it does not answer, twice)."""
        reply = self._claim(keys=[self.keys.job(job_id)], args=[repr(now), claim])
        verdict, fields = reply[0].decode(), reply[1:]
        record = _decode(dict(zip(fields[::2], fields[1::2])))
        if verdict != "claimed":
            return verdict, None, record
        index = self.bulk.index(job_id)
        reader = self._shard_payloads.setdefault(index, PayloadReader(self.bulk.clients[index]))
        for attempt in range(2):
            try:
                return verdict, reader.bulks(("GET", self.keys.upload(job_id)))[0], record
            except SHARD_ERRORS as exc:
                if attempt:
                    self.bulk.mark_down(index)
                    raise ShardUnavailable(index, exc) from exc
        raise AssertionError("unreachable")

    def expire_overdue(self, now: float, limit: int = 500) -> int:
        """End `expired` the live jobs whose deadline passed (the deadline index says which, oldest first, at
        most `limit` a call); how many it ended. Every CPU worker calls it every `celery.sweep_s`: a job
        ends within about that of its deadline whether anyone reads it or not."""
        overdue = cast(list[bytes], self.redis.zrangebyscore(self.keys.deadlines, "-inf", now, start=0, num=limit))
        if not overdue:
            return 0
        ids = [job_id.decode() for job_id in overdue]
        ended = int(self.finish_many([(job_id, EXPIRED, expired_fields("before an answer was written"))
                                      for job_id in ids]))
        self.redis.zrem(self.keys.deadlines, *ids)   # those that had ended otherwise, or whose record expired
        return ended

    def redeliver_callback(self, job_id: str) -> bool:
        """Queue an ended job's callback again from its first attempt (a dead letter, or a delivery the receiver
        lost); False when the job does not exist, has not ended or has no callback."""
        return bool(self._redeliver(keys=[self.keys.job(job_id), self.keys.callback_outbox,
                                          self.keys.callback_scheduled, self.keys.callback_dead], args=[job_id]))

    def fail(self, job_id: str, code: str, message: str, client: Any = None) -> bool:
        return self.finish(job_id, FAILED, {"error": {"code": code, "message": message}}, client=client)

    def expire(self, job_id: str, where: str) -> bool:
        """The job's deadline passed `where` (e.g. "before preprocessing"): it ends `expired`."""
        return self.finish(job_id, EXPIRED, expired_fields(where))


def expired_fields(where: str) -> dict[str, Any]:
    """What an expired job carries: one error code, `deadline`, and where the deadline passed."""
    return {"error": {"code": "deadline", "message": f"expired {where}"}}


def queue_depths(client: redis.Redis, keys: Keys, model_keys: Sequence[str],
                 tenants: Sequence[str] = ("",)) -> dict[str, dict[str, int]]:
    """Per model (name:version): jobs waiting for a CPU worker (its Celery lists, one per tenant: see
    Keys.preprocess_queue) and frames waiting for a GPU worker, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for model_key in model_keys:
        for queue in keys.preprocess_queues(model_key, tenants):
            pipe.llen(keys.celery_queue(queue))
        pipe.llen(keys.frames(model_key))
        pipe.hget(keys.frames_waiting, model_key)   # with bulk shards: their lists' count (contract.shards)
    replies = iter(pipe.execute())
    depths = {}
    for model_key in model_keys:
        preprocess = sum(int(next(replies)) for _ in tenants)
        frames = int(next(replies)) + int(next(replies) or 0)
        depths[model_key] = {"preprocess": preprocess, "frames": frames}
    return depths


def total_depths(depths: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """queue_depths summed over the models."""
    return {"preprocess": sum(d["preprocess"] for d in depths.values()),
            "frames": sum(d["frames"] for d in depths.values())}


def _encode(fields: Mapping[str, Any]) -> dict[str, str]:
    return {name: _encode_value(value) for name, value in fields.items()}


_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))   # one encoder, not one per value


def _encode_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return _COMPACT_JSON.encode(value)
    return str(value)


def _flatten(fields: Mapping[str, Any]) -> list[str]:
    flat: list[str] = []
    for name, value in fields.items():
        flat += [name, _encode_value(value)]
    return flat


def _decode(raw: Mapping[Any, Any]) -> JobRecord:
    """A job hash as redis-py returns it (bytes names and values) -> its record."""
    record: dict[str, Any] = {}
    for name_b, value_b in raw.items():
        name, value = name_b.decode(), value_b.decode()
        if name in JSON_FIELDS:
            record[name] = json.loads(value)
        elif name in STAMP_FIELDS or name in ("deadline_at", "updated_at", "finished_at"):
            record[name] = float(value)
        else:
            record[name] = value
    return cast(JobRecord, record)
