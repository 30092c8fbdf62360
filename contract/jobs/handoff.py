"""The CPU workers' hand-off: a worker claims a queued job and reads its upload, in one round trip.

The claim carries a token of this attempt that the frame's push must show (contract.frames.frame_push's FramePusher): a
task delivered twice is decoded once, and a late attempt (its worker presumed dead, the task claimed again) cannot push.
What the worker does with the job then: push its frame (contract.frames.frame_push), or end it here (`fail`, and
`expire_late` for a claim that answered `late`), with the library's finish_jobs (contract.jobs.ending): the job id goes
from the worker's step to this facade and to Redis, as the claim's does.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import redis

from contract.jobs import expiry
from contract.jobs.ending import FINISH_JOBS, JobEnding, ending_arguments
from contract.jobs.record import EXPIRED, FAILED, JobRecord, decode_record
from contract.jobs.timebill import RECEIVED_AT, SUBMITTED_AT
from contract.library import Step, is_missing
from contract.redis.clock import now as service_now
from contract.redis.keys import UPLOAD_SUFFIX, Keys
from contract.redis.replies import PayloadReader
from contract.redis.shards import SHARD_ERRORS, BulkPlane, ShardUnavailable

# A CPU worker's claim, in one round trip instead of three (read, move, fetch the upload): a plain GET of the
# upload, whose reply is read straight into one buffer (contract.redis.replies), this step, and a plain HMGET of the
# record's CLAIM_FIELDS as the claim left them. (The upload stays out of the script: Lua would copy it in and out
# of its own memory, at a cost to Redis's CPU per image (docs/benchmarks/2026-12-06-control-plane.md, "Bytes into
# Lua"); so do the fields: turned into a Lua table and back into a reply, strings cost the script far more than a
# plain read of them.)
# A claimed job's API key comes back with its frames of the model waiting or in flight (Keys.key_frames): the push
# chooses the end of the list from it (contract.frames.frame_push), with no round trip more.
# The library's `claim_job` (contract/library/handoff.lua, where its keys and arguments are named): a claimed job
# answered with its key's frames alone (an integer), any other verdict as a string.
_CLAIM = Step("claim_job")


# What the CPU worker reads of a record at its claim (tasks/decoding/preprocess.py), and nothing more of its ~23
# fields: how it
# ended when it is over, its model, its deadline and options (the frame's header), the stamps its bill goes on
# from, whether its key's decode share is to be given back, and its key (the frame's header: the GPU worker counts
# the key's frames out by it). A field the record lacks is absent from the reply.
CLAIM_FIELDS = ("status", "model", "deadline_at", "options", RECEIVED_AT, SUBMITTED_AT, "decode_cost", "owner")


class Claimed(NamedTuple):
    """What a claim found: its verdict, the upload (claimed only), the record's CLAIM_FIELDS as the claim left them,
    and the job's API key's frames of its model waiting or in flight (Keys.key_frames; -1: without a key, or not
    counted)."""

    verdict: str
    upload: memoryview | None
    record: JobRecord
    key_frames: int = -1


class JobHandOff(JobEnding):
    """A CPU worker's side of the job records: claims, and the ends it gives a job (expired, failed)."""

    def __init__(
        self, client: redis.Redis, keys: Keys, ttl_s: int, bulk: BulkPlane | None = None, count_key_frames: bool = False
    ) -> None:
        """`count_key_frames`: a claim reads its key's frames (backpressure.head_frames_per_key above 0)."""
        super().__init__(client, keys, ttl_s, bulk)
        self._key_frames_prefix = keys.key_frames_prefix if count_key_frames else ""
        self._payloads: PayloadReader | None = None  # uploads read in one copy
        self._shard_payloads: dict[int, PayloadReader] = {}

    def claim_for_preprocessing(self, job_id: str, now: float, claim: str = "") -> Claimed:
        """A CPU worker takes a queued job as `claim` (its push must show it): verdict, upload, record and its key's
        frames in one round trip; see _CLAIM.
        A claimed job whose upload expired comes back with `upload` None. (The upload is read before
        the claim, in the same round trip: a job past this stage has no upload left to read.)"""
        if self.bulk.sharded:
            return self._claim_from_shard(job_id, now, claim)
        if self._payloads is None:
            self._payloads = PayloadReader(self.redis)
        job_key = self.job_prefix + job_id  # named here (Keys.job_prefix)
        commands = (
            ("GET", job_key + UPLOAD_SUFFIX),
            ("FCALL", _CLAIM.name, 1, job_key, repr(now), claim, self._key_frames_prefix),
            ("HMGET", job_key, *CLAIM_FIELDS),
        )
        reconnected = reloaded = False
        while True:
            try:
                upload, reply, fields = self._payloads.execute(*commands)
            except redis.ConnectionError:
                # A connection Redis dropped (it restarted) fails on its first use: once more on a new one, as
                # redis-py's own client does. Both steps may run twice: a claim may be claimed again.
                if reconnected:
                    raise
                reconnected = True
                continue
            if is_missing(reply) and not reloaded:
                _CLAIM.recover(self.redis)  # a Redis that came back empty: the library loaded, the claim again
                reloaded = True
                continue
            for answer in (upload, reply, fields):
                if isinstance(answer, redis.ResponseError):
                    raise answer
            break
        verdict, record, key_frames = _claimed(reply, fields)
        return Claimed(verdict, upload if verdict == "claimed" else None, record, key_frames)

    def _claim_from_shard(self, job_id: str, now: float, claim: str) -> Claimed:
        """claim_for_preprocessing with bulk shards: the claim on the control plane, then, if claimed, the
        upload from the job's shard (ShardUnavailable when it does not answer, twice)."""
        job_key = self.job_prefix + job_id
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=False)
            _CLAIM(pipe, [job_key], [repr(now), claim, self._key_frames_prefix])
            pipe.hmget(job_key, CLAIM_FIELDS)
            replies = pipe.execute(raise_on_error=False)
            if not is_missing(replies[0]) or attempt:
                break
            _CLAIM.recover(self.redis)  # a Redis that came back empty: the library loaded, the claim again
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        verdict, record, key_frames = _claimed(*replies)
        if verdict != "claimed":
            return Claimed(verdict, None, record)
        index = self.bulk.index(job_id)
        reader = self._shard_payloads.setdefault(index, PayloadReader(self.bulk.clients[index]))
        for attempt in range(2):
            try:
                return Claimed(verdict, reader.bulks(("GET", job_key + UPLOAD_SUFFIX))[0], record, key_frames)
            except SHARD_ERRORS as exc:
                if attempt:
                    self.bulk.mark_down(index)
                    raise ShardUnavailable(index, exc) from exc
        raise AssertionError("unreachable")

    def fail(self, job_id: str, code: str, message: str, client: Any = None) -> bool:
        """The job ends failed with `code` (its decode failed, its upload or its model is missing here), unless
        something ended it first: whether this did. JobEnding.fail, its keys named here."""
        return self._end(job_id, FAILED, {"error": {"code": code, "message": message}}, client)

    def expire_late(self, job_id: str) -> bool:
        """A claim answered `late` (its step judged the deadline: contract.jobs.expiry): the job ends expired before
        preprocessing, unless something ended it first, and its upload goes now, a shard's bytes too."""
        ended = self._end(job_id, EXPIRED, expiry.expired_fields(expiry.BEFORE_PREPROCESSING))
        job_key = self.job_prefix + job_id
        self.drop_upload_at(job_key + UPLOAD_SUFFIX, self.bulk.client_for(job_id) if self.bulk.sharded else None)
        return ended

    def _end(self, job_id: str, status: str, fields: dict[str, Any], client: Any = None) -> bool:
        """JobEnding.finish of one job, its keys named here."""
        keys = [self.keys.callback_outbox, self.job_prefix + job_id]
        args = [*self.finish_names(), job_id, *ending_arguments(status, fields, service_now())]
        return bool(FINISH_JOBS(client or self.redis, keys, args))


def _claimed(verdict: Any, values: Any) -> tuple[str, JobRecord, int]:
    """The claim's verdict, the record's CLAIM_FIELDS read after it (their values in order, None where absent) and
    the key's frames (claim_job's integer for a claim, else a verdict alone)."""
    fields = {name.encode(): bytes(value) for name, value in zip(CLAIM_FIELDS, values) if value is not None}
    key_frames = -1
    if isinstance(verdict, int):
        verdict, key_frames = "claimed", verdict
    text = bytes(verdict).decode() if isinstance(verdict, (bytes, memoryview)) else str(verdict)
    return text, decode_record(fields) if fields else cast(JobRecord, {}), key_frames
