"""The API's intake: a new job stored with its upload and its Celery task, or answered from the result cache.

`take_in` is a submission's whole intake in one round trip to the control plane: the upload stored first (on its
bulk shard, or on the control plane in the same transaction), then one transaction that writes the record, the
deadline entry and the task and ends with the step `take_in` (contract/library/intake.lua), which judges them: the
result cache's lookup, the admission (contract.admission.budget's admit), the decode charge
(contract.admission.decode_share). A hit or a refusal takes the job's writes and its upload back: nothing of a
refused submission is kept. With replicas to reach (settings.redis), a 202 waits until they hold the job (Redis WAIT,
contract.redis.connection); too few in time and the job is withdrawn (`NotReplicated`). The API's admission
(app.admission) builds what it asks and decides what to do with the answer.

`create` (the job alone, admitted before) and `answer_or_admit` (the lookup and the admission alone) are the two
steps take_in merged, kept for the tests and bench's replay that price each.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import redis

from contract.admission import budget
from contract.cache import CacheLimits, MissCounts
from contract.cache.cache_plane import CachePlane
from contract.jobs.ending import JobEnding
from contract.jobs.hits import RESULT_REF, HitLimited, HitLimits
from contract.jobs.record import FAILED, QUEUED, QUEUED_GPU, SUCCEEDED, encode_fields, flatten_fields
from contract.library import Step, is_missing
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.redis.replication import NO_REPLICATION, AnswerNotReplicated, NotReplicated, Replication, SharedFence
from contract.redis.shards import SHARD_ERRORS, SHARDED_UPLOAD, UPLOAD_FIELD, BulkPlane, ShardUnavailable

log = logging.getLogger(__name__)

# The step `lookup_or_admit` (contract/library/intake.lua): the result cache's lookup and, on a miss, the job's
# admission, in one round trip. A miss is nearly every call and a hit's record is not needed for it: every
# argument a step is sent costs Redis a fixed amount of work, and each of its bytes a little more, so what a call
# does not use is not sent (docs/benchmarks/2026-12-07-comment-figures.md).
_LOOKUP_OR_ADMIT = Step("lookup_or_admit")
_STORE_HIT = Step("store_hit")  # contract/library/hits.lua
# With the cache on a Redis of its own (contract.cache.cache_plane): the lookup there, the admission alone here on a
# miss, and on a hit the hit's job stored here from the answer read there.
_ADMIT, _STORE_HIT_ANSWER = Step("admit"), Step("store_hit_answer")
# The step `take_in` (contract/library/intake.lua): the lookup, the admission, the decode charge and the job, in one.
_TAKE_IN = Step("take_in_job")

# A new record's first fields: those later steps read or overwrite. configs/redis.conf makes every hash a hash table,
# where order costs nothing; on a Redis left at its listpack default a record is searched from its head, and a field
# near it is found sooner.
STEPS_READ_FIRST = ("model", "deadline_at", "bytes", UPLOAD_FIELD, "cache_key", "owner")

LARGE_UPLOAD_BYTES = 2 * 1024 * 1024  # a connection that carried a larger upload is closed after it


def record_ttl_s(ttl_s: int, deadline_at: Any) -> int:
    """A new record's TTL: until `ttl_s` past its deadline, so that it stays at least `ttl_s` after whatever ends
    it (the sweeper ends it at its deadline at the latest), and its end need not set a TTL again (one EXPIRE an
    image less: finish_jobs sets one only on a record without a deadline)."""
    if deadline_at is None:
        return ttl_s
    return ttl_s + max(0, math.ceil(float(deadline_at) - service_now()))


class CacheHit(NamedTuple):
    """A submission the result cache answered (JobIntake.answer_or_admit): how its job ended, and the cached
    result document (JSON text), which the job holds only if it ended `succeeded`."""

    status: str
    document: str


class DecodeCharge(NamedTuple):
    """An upload's decode charged to its API key with its job (contract.admission.decode_share)."""

    cost: int
    share: int  # what the key may hold in flight
    lapse_at: float  # when the charge lapses by itself


class NewJob(NamedTuple):
    """What JobIntake.take_in makes a job of: the upload and its record's fields, its Celery task (a queue's list
    key, the message), and what it must pass first: the cache's lookup (`digest`), the budgets (`admission`: None when
    its bytes were reserved before its body was read, `reserved` of them), the decode charge (`decode`)."""

    job_id: str
    upload: bytes
    upload_ttl_s: int
    fields: Mapping[str, Any]
    task: tuple[str, bytes] | None = None
    admission: budget.AdmissionRequest | None = None
    reserved: int = 0
    digest: str | None = None
    decode: DecodeCharge | None = None


class DecodeRefused(NamedTuple):
    """take_in's refusal by the decode charge: what the key holds in flight already."""

    held: int


class Created(NamedTuple):
    """take_in's job made; `verdict`: the admission's figures when take_in sent them (take_in_job sends none)."""

    verdict: budget.BudgetVerdict | None


class HitTerms(NamedTuple):
    """What take_in stores a cache hit's job with (answer_or_admit's arguments): the entry's digest and TTL, the
    hit's record fields and time bill, and the API key whose hit bucket it is charged to."""

    digest: str
    ttl_s: int
    fields: Mapping[str, Any]
    timings: Mapping[str, float]
    client_id: str = ""


TakenIn = CacheHit | HitLimited | budget.BudgetVerdict | DecodeRefused | Created


def _as_verdict(reply: Any) -> Any:
    """take_in_job's reply as take_in's: its 1 (a job made) as [b"created"], any other as it came."""
    return [b"created"] if isinstance(reply, int) else reply


def _taken_in(reply: Any, admitted_here: bool) -> TakenIn:
    """take_in's reply other than a hit: a refusal (HitLimited: the key's answers overdrew its bucket), or the job
    made."""
    if reply[0] == b"decode_share":
        return DecodeRefused(int(reply[1]))
    if reply[0] == b"answer_debt":
        return HitLimited(int(reply[1]))
    if reply[0] != b"created":
        return budget.BudgetVerdict.of(reply)
    if not admitted_here or len(reply) < 5:  # take_in_job's 1: made, its admission's figures not sent
        return Created(None)
    return Created(budget.BudgetVerdict(budget.ADMITTED, *(int(value) for value in reply[1:5])))


class JobIntake(JobEnding):
    """The API's side of the job records: new jobs in, and the ones it ends (a withdrawal, a cache hit)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        ttl_s: int,
        uploads: redis.Redis | None = None,
        bulk: BulkPlane | None = None,
        cache: CacheLimits | None = None,
        replication: Replication = NO_REPLICATION,
        hits: HitLimits | None = None,
        results_as_text: bool = False,
        cache_plane: CachePlane | None = None,
    ) -> None:
        """`uploads`: the client uploads are written with (a few connections, see `_write_upload`).
        `replication`: how many replicas a new job must reach before `create` (or a cache hit) returns.
        `hits`: what bounds each key's cache hits (contract.jobs.hits); None: nothing but the records' TTL.
        `results_as_text`: as JobStore's (the API's: it serves results as stored).
        `cache_plane`: the cache's own Redis (contract.cache.cache_plane); None: the cache on this control plane."""
        super().__init__(client, keys, ttl_s, bulk, cache, results_as_text)
        self.uploads = uploads or client
        self.replication = replication
        self.hits = hits or HitLimits(0, ttl_s, ttl_s)
        self.misses = MissCounts()  # added to the shared counters by flush_counts
        self.cache_plane = cache_plane
        self._fence = SharedFence(self._fence_round)  # reads that show how a job ended (confirm_durable)
        self._fenced = (0, 0)  # the last round's (acknowledged, wanted)

    def create(
        self,
        job_id: str,
        upload: bytes,
        upload_ttl_s: int,
        fields: Mapping[str, Any],
        task: tuple[str, bytes] | None = None,
        reserved: int = 0,
    ) -> None:
        """Store the upload (claim check), then the record and `task` (a queue's list key, the message for it)
        in one transaction: no job without its task or task without its job. Without bulk shards or replicas,
        an upload up to LARGE_UPLOAD_BYTES is written in that transaction (one round trip in all).
        `reserved`: the bytes admitted for it (contract.admission.budget); what the upload does not use is given
        back."""
        record: dict[Any, Any] = {"status": QUEUED, **dict.fromkeys(STEPS_READ_FIRST)}
        record.update(id=job_id, **encode_fields(fields))
        upload_key = self.keys.upload(job_id)
        pipe = self.redis.pipeline(transaction=True)
        if self.bulk.sharded:
            shard = self.bulk.index(job_id)
            try:
                self._write_upload(self.bulk.clients[shard], upload_key, upload_ttl_s, upload)
            except SHARD_ERRORS as exc:
                self.bulk.mark_down(shard)
                raise ShardUnavailable(shard, exc) from exc
            record[UPLOAD_FIELD] = SHARDED_UPLOAD  # the marker, a field of the record (contract.redis.shards)
        elif self.replication.enabled or len(upload) > LARGE_UPLOAD_BYTES:
            self._write_upload(self.uploads, upload_key, upload_ttl_s, upload)
        else:
            # The upload in the job's own transaction, on the uploads' connections: one round trip, not two. Its
            # value is still last in its command, so Redis keeps the read buffer as the value (_write_upload).
            pipe = self.uploads.pipeline(transaction=True)
            pipe.execute_command("SETEX", upload_key, upload_ttl_s, upload)  # type: ignore[no-untyped-call]
        record = {name: value for name, value in record.items() if value is not None}  # a field not given: absent
        unused = reserved - len(upload)
        if reserved and unused > 0 and fields.get("model"):  # a multipart body's own bytes around the image
            pipe.hincrby(self.keys.waiting_bytes, str(fields["model"]), -unused)
            if fields.get("owner"):  # reserved for its API key too (contract.admission.budget)
                pipe.hincrby(self.keys.key_waiting_bytes(str(fields["owner"])), str(fields["model"]), -unused)
        pipe.hset(self.keys.job(job_id), mapping=record)
        pipe.expire(self.keys.job(job_id), record_ttl_s(self.ttl_s, fields.get("deadline_at")))
        if "deadline_at" in fields:  # the sweeper ends it there if nothing else has (expire_overdue)
            pipe.zadd(self.keys.deadlines, {job_id: float(fields["deadline_at"])})
        if task is not None:
            pipe.lpush(*task)
        try:
            if self.replication.enabled:
                written = self.keys.job(job_id) if self.bulk.sharded else upload_key  # the upload, where it is
                # WAIT after the transaction, on its connection: the upload, written before it, is acknowledged
                # with it (a replica's offset covers everything the primary wrote before). The transaction also
                # looks for the upload: written to a primary that a failover replaced since, it is not there.
                replies, acknowledged, wanted = self.replication.wait(
                    self.redis,
                    [("MULTI",), *(args for args, _ in pipe.command_stack), ("EXISTS", written), ("EXEC",)],
                )
                if not replies[-1][-1]:  # the upload went to a server that is no longer the primary: so do all
                    self.uploads.connection_pool.disconnect(inuse_connections=False)  # the uploads' idle connections
                if acknowledged < wanted or not replies[-1][-1]:
                    raise NotReplicated(acknowledged if replies[-1][-1] else 0, wanted)
            else:
                pipe.execute()
        except NotReplicated:
            self.withdraw(job_id)
            raise
        except redis.RedisError:
            self._delete_quietly(upload_key)  # no job holds it: it would wait for its TTL
            if self.bulk.sharded:
                self._delete_quietly(upload_key, self.bulk.client_for(job_id))
            raise

    def take_in(self, job: NewJob, hit: HitTerms | None = None) -> TakenIn:
        """A new job in one round trip to the control plane (the step `take_in`): with `hit` the result cache's
        lookup first (a hit: the job stored ended, as answer_or_admit's), then the budgets' admission unless
        `job.admission` is None (reserved before: what the upload does not use of `job.reserved` is given back),
        the decode charge, and the job with its task. Refused, nothing of it is kept: not its record, not its
        bytes, not its upload (stored first: on its bulk shard, or on this Redis in the step's own transaction).
        With replicas to reach, a job made waits for them as create's does (NotReplicated: withdrawn)."""
        lookup = self.keys.cache_entry(hit.digest) if hit is not None else ""
        if hit is not None and self.cache_plane is not None:  # looked up there, before the upload is stored
            found = self.cache_plane.lookup(lookup)
            taken = self._hit(job, hit, found.decode(), answer=found) if found is not None else None
            if taken is not None:
                return taken
            lookup = ""
        for _ in range(3):  # an entry that goes between the lookup and the hit's step: looked up again
            reply = self._take_in_once(job, lookup)
            if reply[0] != b"hit" or hit is None:
                if hit is not None:
                    self.misses.count(str(job.fields["model"]))
                return _taken_in(reply, job.admission is not None)
            taken = self._hit(job, hit, bytes(reply[1]).decode())
            if taken is not None:
                return taken
        raise redis.RedisError(f"the cache entry {hit and hit.digest} went at each of three lookups")

    def _hit(
        self, job: NewJob, hit: HitTerms, document: str, answer: bytes | None = None
    ) -> CacheHit | HitLimited | None:
        """A hit's job stored ended (store_hit, or store_hit_answer with the `answer` read from the cache's Redis):
        CacheHit, HitLimited, or None when the entry went meanwhile."""
        model = str(job.fields["model"])
        stored = self._store_hit_job(
            job.job_id, hit.fields, hit.digest, hit.ttl_s, hit.timings, model, hit.client_id, answer=answer
        )
        if stored[0] == b"limited":
            return HitLimited(int(stored[1]))
        if stored[0] != b"ended":
            return None
        if self.cache_plane is not None and answer is not None:
            self.cache_plane.touch(self.keys.cache_entry(hit.digest), self.keys.cache_stats, model, hit.ttl_s)
        return CacheHit(bytes(stored[1]).decode(), document)

    def _take_in_once(self, job: NewJob, lookup: str) -> Any:
        """The upload stored, then the step `take_in` (with it in one transaction where it is small, on this Redis,
        and no replica is waited for): the step's reply. An upload no job holds is deleted."""
        job_id, upload, fields = job.job_id, job.upload, job.fields
        upload_key = self.keys.upload(job_id)
        record: dict[Any, Any] = {"status": QUEUED, **dict.fromkeys(STEPS_READ_FIRST)}
        record.update(id=job_id, **encode_fields(fields))
        here, inline = "", False  # the upload on this Redis before the step; in the step's transaction
        if self.bulk.sharded:
            shard = self.bulk.index(job_id)
            try:
                self._write_upload(self.bulk.clients[shard], upload_key, job.upload_ttl_s, upload)
            except SHARD_ERRORS as exc:
                self.bulk.mark_down(shard)
                raise ShardUnavailable(shard, exc) from exc
            record[UPLOAD_FIELD] = SHARDED_UPLOAD
        else:
            here = upload_key
            inline = not self.replication.enabled and len(upload) <= LARGE_UPLOAD_BYTES
            if not inline:
                self._write_upload(self.uploads, upload_key, job.upload_ttl_s, upload)
        flat = [item for pair in record.items() if pair[1] is not None for item in pair]  # encoded: HSET's arguments
        deadline_at = fields.get("deadline_at")
        writes: list[tuple[Any, ...]] = [
            ("HSET", self.keys.job(job_id), *flat),
            ("EXPIRE", self.keys.job(job_id), record_ttl_s(self.ttl_s, deadline_at)),
        ]
        if deadline_at is not None:  # the sweeper ends it there if nothing else has (expire_overdue)
            writes.append(("ZADD", self.keys.deadlines, repr(float(deadline_at)), job_id))
        if job.task is not None:
            writes.append(("LPUSH", *job.task))
        if inline:  # the upload in the job's own transaction, last in its command (_write_upload), on its connections
            writes.insert(0, ("SETEX", upload_key, job.upload_ttl_s, upload))
        keys, args = self._take_in_arguments(job, lookup, here)
        try:
            reply = self._call_take_in(job, writes, keys, args)
        except NotReplicated:
            raise
        except redis.RedisError:
            self._delete_quietly(upload_key)  # no job holds it: it would wait for its TTL
            if self.bulk.sharded:
                self._delete_quietly(upload_key, self.bulk.client_for(job_id))
            if job.decode is not None:
                self._forget_charge(job_id)
            raise
        if reply[0] != b"created" and self.bulk.sharded:  # refused or answered: its upload goes
            self._delete_quietly(upload_key, self.bulk.client_for(job_id))
        return reply

    def _take_in_arguments(self, job: NewJob, lookup: str, here: str) -> tuple[list[Any], list[Any]]:
        """take_in's keys and arguments (their positions: contract/library/intake.lua)."""
        fields, decode = job.fields, job.decode
        admission_keys, admission_args = (
            budget.admission_arguments(self.keys, job.admission) if job.admission is not None else ([], [])
        )
        keys = [
            lookup,
            self.keys.job(job.job_id),
            self.keys.deadlines,
            job.task[0] if job.task else "",
            here,
            self.keys.decode_share if decode is not None else "",
            self.keys.waiting_bytes,
            "",
            *admission_keys,
        ]
        unused = max(0, job.reserved - len(job.upload)) if job.admission is None else 0
        charge = (decode.cost, decode.share, repr(service_now()), repr(decode.lapse_at)) if decode else ()
        owner = str(fields.get("owner") or "")
        if owner and self.hits.bucket_bytes > 0:
            keys[7] = self.keys.answer_debt(owner)
        return keys, [str(fields.get("model") or ""), owner, unused, job.job_id, *admission_args, *charge]

    def _call_take_in(self, job: NewJob, writes: list[tuple[Any, ...]], keys: list[Any], args: list[Any]) -> Any:
        """The job's `writes`, then the step, in one transaction (with WAIT for the replicas when there are): the
        step's reply. A Redis without the library ran the writes and not the step: it gets the library, then the
        step alone, told where the job's message may be now."""
        fcall = ("FCALL", _TAKE_IN.name, len(keys), *keys, *args)
        try:
            if self.replication.enabled:
                return self._take_in_replicated(job, [*writes, fcall], in_multi=True)
            client = self.uploads if writes[0][0] == "SETEX" else self.redis
            pipe = client.pipeline(transaction=True)
            for command in (*writes, fcall):
                pipe.execute_command(*command)  # type: ignore[no-untyped-call]
            return _as_verdict(pipe.execute()[-1])
        except redis.ResponseError as error:
            if not is_missing(error):
                raise
        _TAKE_IN.recover(self.redis)
        args = [*args, *([job.task[1]] if job.task else [])]  # the message's place is not known now: its value
        if self.replication.enabled:
            return self._take_in_replicated(job, [("FCALL", _TAKE_IN.name, len(keys), *keys, *args)], in_multi=False)
        return _as_verdict(_TAKE_IN(self.redis, keys, args))

    def _take_in_replicated(self, job: NewJob, commands: list[tuple[Any, ...]], in_multi: bool) -> Any:
        """`commands` (the step last, in a transaction or alone), then whether the job's upload is still where it
        was written (a failover since: not), then WAIT: the step's reply, or NotReplicated and the job withdrawn."""
        written = self.keys.job(job.job_id) if self.bulk.sharded else self.keys.upload(job.job_id)
        if in_multi:
            replies, acknowledged, wanted = self.replication.wait(
                self.redis, [("MULTI",), *commands, ("EXISTS", written), ("EXEC",)]
            )
            reply, found = replies[-1][-2], replies[-1][-1]
        else:
            replies, acknowledged, wanted = self.replication.wait(self.redis, [*commands, ("EXISTS", written)])
            reply, found = replies[0], replies[-1]
        reply = _as_verdict(reply)
        if reply[0] != b"created":
            return reply
        if not found:  # the upload went to a server that is no longer the primary: so do all
            self.uploads.connection_pool.disconnect(inuse_connections=False)
        if acknowledged < wanted or not found:
            self.withdraw(job.job_id)
            if job.decode is not None:
                self._forget_charge(job.job_id)
            raise NotReplicated(acknowledged if found else 0, wanted)
        return reply

    def _forget_charge(self, job_id: str) -> None:
        """A job not made after all: its decode charge goes now (Redis away: it lapses by itself)."""
        try:
            self.redis.hdel(self.keys.decode_share, job_id)
        except redis.RedisError:
            pass

    def flush_counts(self) -> int:
        """The cache misses this process counted, added to the shared counters (the API's sweeper tick); on a cache
        Redis of its own that is away, kept for a later tick."""
        if self.cache_plane is None:
            return self.misses.flush(self.redis, self.keys.cache_stats)
        return self.cache_plane.call(lambda client: self.misses.flush(client, self.keys.cache_stats)) or 0

    def withdraw(self, job_id: str) -> None:
        """A job stored on the primary that too few replicas acknowledged: its submitter is told 503 (retry), so
        it ends here and no worker spends anything on it. Quietly: Redis may be going away as well."""
        try:
            self.finish(
                job_id,
                FAILED,
                {
                    "error": {
                        "code": "not_replicated",
                        "message": "stored on too few replicas in time; the submission was refused (503)",
                    }
                },
            )
        except redis.RedisError:
            log.warning("could not withdraw job %s, stored on too few replicas", job_id)

    def answer_or_admit(
        self,
        job_id: str,
        fields: Mapping[str, Any],
        digest: str,
        cache_ttl_s: int,
        timings: Mapping[str, float],
        admission: budget.AdmissionRequest,
        client_id: str = "",
    ) -> CacheHit | HitLimited | budget.BudgetVerdict:
        """A job the result cache may answer. On a hit for `digest`: the job stored over already, referring to the
        cached answer (contract.jobs.hits) with `timings`, ended as any job ends (long-polls, callback), its bytes
        taken from `client_id`'s hit bucket; (its status, the result document as JSON text). The status is
        `expired`, without the answer, when the hit came after the job's deadline (deadline_ms shorter than the
        lookup). HitLimited, nothing stored, when the key's hits have used their bytes. On a miss: the budgets'
        verdict on `admission` (its bytes reserved when admitted), nothing stored, in one round trip
        (_LOOKUP_OR_ADMIT); a hit takes a second. A hit needs no admission: it adds nothing to wait."""
        if self.cache_plane is not None:
            return self._answer_or_admit_apart(
                self.cache_plane, job_id, fields, digest, cache_ttl_s, timings, admission, client_id
            )
        admission_keys, admission_args = budget.admission_arguments(self.keys, admission)
        for _ in range(3):  # an entry that goes between the lookup and the hit's step: looked up again
            reply = _LOOKUP_OR_ADMIT(self.redis, [self.keys.cache_entry(digest), *admission_keys], admission_args)
            if reply[0] != b"hit":
                self.misses.count(admission.model_key)
                return budget.BudgetVerdict.of(reply)
            document = bytes(reply[1]).decode()
            stored = self._store_hit_job(job_id, fields, digest, cache_ttl_s, timings, admission.model_key, client_id)
            if stored[0] == b"ended":
                return CacheHit(bytes(stored[1]).decode(), document)
            if stored[0] == b"limited":
                return HitLimited(int(stored[1]))
        raise redis.RedisError(f"the cache entry {digest} went at each of three lookups")

    def _answer_or_admit_apart(
        self,
        plane: CachePlane,
        job_id: str,
        fields: Mapping[str, Any],
        digest: str,
        cache_ttl_s: int,
        timings: Mapping[str, float],
        admission: budget.AdmissionRequest,
        client_id: str,
    ) -> CacheHit | HitLimited | budget.BudgetVerdict:
        """answer_or_admit with the cache on its own Redis: looked up there (away or slow: a miss), then the hit's
        job stored here from the answer read, or the miss admitted here; a hit's books written there after."""
        found = plane.lookup(self.keys.cache_entry(digest))
        if found is None:
            self.misses.count(admission.model_key)
            admission_keys, admission_args = budget.admission_arguments(self.keys, admission)
            return budget.BudgetVerdict.of(_ADMIT(self.redis, admission_keys, admission_args))
        stored = self._store_hit_job(
            job_id, fields, digest, cache_ttl_s, timings, admission.model_key, client_id, answer=found
        )
        if stored[0] == b"limited":
            return HitLimited(int(stored[1]))
        plane.touch(self.keys.cache_entry(digest), self.keys.cache_stats, admission.model_key, cache_ttl_s)
        return CacheHit(bytes(stored[1]).decode(), found.decode())

    def _store_hit_job(
        self,
        job_id: str,
        fields: Mapping[str, Any],
        digest: str,
        cache_ttl_s: int,
        timings: Mapping[str, float],
        model_key: str,
        client_id: str,
        answer: bytes | None = None,
    ) -> Any:
        """The step `store_hit` for one hit (`answer`: store_hit_answer's, with the answer read): its reply."""
        # stored as past its push, for the moment the step takes: it has no upload for finish_jobs to delete
        record = flatten_fields({"id": job_id, "status": QUEUED_GPU, **fields, RESULT_REF: digest})
        job_keys, job_args = self.finish_arguments([(job_id, SUCCEEDED, {"timings": timings})])
        keys = [
            self.keys.callback_outbox,
            self.keys.cache_entry(digest),
            self.keys.cache_lru,
            self.keys.cache_stats,
            self.keys.hit_result(digest),
            self.keys.hit_bucket(client_id),
            *job_keys,
        ]
        charge = self.hits.charge(sum(map(len, record)) + sum(map(len, job_args[2:])), "callback_url" in fields)
        args = [
            *self.finish_names(),
            digest,
            repr(service_now()),
            cache_ttl_s,
            model_key,
            self.hits.answer_ttl_s,
            self.hits.bucket_bytes,
            repr(self.hits.refill_per_s),
            charge,
            self.hits.answer_lifetimes,
            len(record),
            *record,
            *job_args,
            *([answer] if answer is not None else []),
        ]
        step = _STORE_HIT if answer is None else _STORE_HIT_ANSWER
        if not self.replication.enabled:
            return step(self.redis, keys, args)
        # a hit is a new job, answered: on its replicas before the 202 says so (a miss waits at `create`)
        reply, acknowledged, wanted = self._step_and_wait(step, keys, args)
        if reply[0] == b"ended" and acknowledged < wanted:
            raise NotReplicated(acknowledged, wanted)
        return reply

    def _step_and_wait(self, step: Step, keys: list[Any], args: list[Any]) -> tuple[Any, int, int]:
        """A library step's FCALL, then WAIT on its connection (Replication.wait): (its reply, replicas that
        acknowledged, replicas wanted). A Redis without the library (a new primary that lost it) gets it first."""
        command = ("FCALL", step.name, len(keys), *keys, *args)
        try:
            replies, acknowledged, wanted = self.replication.wait(self.redis, [command])
        except redis.ResponseError as error:
            if not is_missing(error):
                raise
            step.recover(self.redis)
            replies, acknowledged, wanted = self.replication.wait(self.redis, [command])
        return replies[0], acknowledged, wanted

    def confirm_durable(self) -> None:
        """Before a read shows how a job ended: that end is on the replicas a 202 waits for, so no failover can
        take it back (AnswerNotReplicated otherwise: the reader asks again). Nothing to do without replicas.
        A PUBLISH on its own connection, then WAIT: a replica's acknowledged offset covers everything the
        primary wrote before it, the end included (PUBLISH travels the replication stream and stores nothing)."""
        if not self.replication.enabled:
            return
        if not self._fence.confirm():
            raise AnswerNotReplicated(*self._fenced)

    def _fence_round(self) -> bool:
        """One round of the readers' shared fence (contract.redis.replication.SharedFence)."""
        _, acknowledged, wanted = self.replication.wait(self.redis, [("PUBLISH", self.keys.durable_fence, "")])
        self._fenced = (acknowledged, wanted)
        return acknowledged >= wanted

    def _write_upload(self, client: redis.Redis, key: str, ttl_s: int, upload: bytes) -> None:
        """The upload alone on the wire and last in its command (SETEX key ttl value): Redis then keeps the
        buffer it read the value into as the value (followed by anything, SET's own EX or the transaction's
        next command, it copies it). Redis also gives that connection a new buffer the upload's size, and keeps
        it while the connection stays busy: so uploads go over few connections (the API's `uploads` client),
        and one that carried an upload over LARGE_UPLOAD_BYTES is closed after it."""
        if len(upload) <= LARGE_UPLOAD_BYTES:
            client.execute_command("SETEX", key, ttl_s, upload)  # type: ignore[no-untyped-call]  # setex() warns
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
