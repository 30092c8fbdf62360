"""The CPU workers' hand-off: a worker claims a queued job and reads its upload, in one round trip.

The claim carries a token of this attempt that the frame's push must show (contract.frame_push's FramePusher): a task
delivered twice is decoded once, and a late attempt (its worker presumed dead, the task claimed again) cannot push.
What the worker does with the job then: push its frame (contract.frame_push), or end it (contract.jobs.ending).
"""

from __future__ import annotations

from typing import Any, cast

import redis

from contract.deadlines import DEADLINE_PASSED_LUA
from contract.jobs.ending import JobEnding
from contract.jobs.record import PREPROCESSING, QUEUED, JobRecord, decode_record
from contract.keys import Keys
from contract.replies import PayloadReader
from contract.shards import SHARD_ERRORS, BulkPlane, ShardUnavailable
from contract.timebill import CPU_STARTED_AT, RECEIVED_AT, SUBMITTED_AT

# A CPU worker's claim, in one round trip instead of three (read, move, fetch the upload): a plain GET of the
# upload, whose reply is read straight into one buffer (contract.replies), this step, and a plain HMGET of the
# record's CLAIM_FIELDS as the claim left them. (The upload stays out of the script: Lua would copy 0.8 MB in and
# out of its own memory, which cost Redis 1.5 ms of CPU per image; so do the fields: turned into a Lua table and
# back into a reply, strings cost the script far more than a plain read of them.)
# KEYS[1] job hash; ARGV[1] now, ARGV[2] the claim (a token of this attempt, which its push must show).
# Returns 'claimed' (now preprocessing), 'missing', 'over' (past this stage or ended), 'late' (deadline passed,
# unchanged: the caller ends it).
_CLAIM = (
    DEADLINE_PASSED_LUA
    + f"""
local was = redis.call('HMGET', KEYS[1], 'status', 'deadline_at')
local status = was[1]
if not status then return 'missing' end
if status ~= '{QUEUED.value}' and status ~= '{PREPROCESSING.value}' then return 'over' end
if deadline_passed(tonumber(was[2]), ARGV[1]) then return 'late' end
redis.call('HSET', KEYS[1], 'status', '{PREPROCESSING.value}', '{CPU_STARTED_AT}', ARGV[1], 'updated_at', ARGV[1],
           'claim', ARGV[2])
return 'claimed'
"""
)


# What the CPU worker reads of a record at its claim (tasks/preprocess.py), and nothing more of its ~23 fields: how it
# ended when it is over, its model, its deadline and options (the frame's header), the stamps its bill goes on
# from, and whether its key's decode share is to be given back. A field the record lacks is absent from the reply.
CLAIM_FIELDS = ("status", "model", "deadline_at", "options", RECEIVED_AT, SUBMITTED_AT, "decode_cost")


class JobHandOff(JobEnding):
    """A CPU worker's side of the job records: claims, and the ends it gives a job (expired, failed)."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int, bulk: BulkPlane | None = None) -> None:
        super().__init__(client, keys, ttl_s, bulk)
        self._claim = client.register_script(_CLAIM)
        self._payloads: PayloadReader | None = None  # uploads read in one copy
        self._shard_payloads: dict[int, PayloadReader] = {}

    def claim_for_preprocessing(
        self, job_id: str, now: float, claim: str = ""
    ) -> tuple[str, memoryview | None, JobRecord]:
        """A CPU worker takes a queued job as `claim` (its push must show it): (verdict, upload, record) in one
        round trip; see _CLAIM.
        A claimed job whose upload expired comes back with `upload` None. (The upload is read before
        the claim, in the same round trip: a job past this stage has no upload left to read.)"""
        if self.bulk.sharded:
            return self._claim_from_shard(job_id, now, claim)
        if self._payloads is None:
            self._payloads = PayloadReader(self.redis)
        commands = (
            ("GET", self.keys.upload(job_id)),
            ("EVALSHA", self._claim.sha, 1, self.keys.job(job_id), repr(now), claim),
            ("HMGET", self.keys.job(job_id), *CLAIM_FIELDS),
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
            if isinstance(reply, redis.ResponseError) and str(reply).startswith("NOSCRIPT") and not reloaded:
                self.redis.script_load(_CLAIM)  # a restarted Redis forgot it: load it, try again
                reloaded = True
                continue
            for answer in (upload, reply, fields):
                if isinstance(answer, redis.ResponseError):
                    raise answer
            break
        verdict, record = _claimed(reply, fields)
        return verdict, (upload if verdict == "claimed" else None), record

    def _claim_from_shard(self, job_id: str, now: float, claim: str) -> tuple[str, memoryview | None, JobRecord]:
        """claim_for_preprocessing with bulk shards: the claim on the control plane, then, if claimed, the
        upload from the job's shard (ShardUnavailable when it does not answer, twice)."""
        for attempt in range(2):
            # EVALSHA by hand: redis-py's Script in a pipeline asks SCRIPT EXISTS first, a round trip more each time
            pipe = self.redis.pipeline(transaction=False)
            pipe.evalsha(self._claim.sha, 1, self.keys.job(job_id), repr(now), claim)
            pipe.hmget(self.keys.job(job_id), CLAIM_FIELDS)
            replies = pipe.execute(raise_on_error=False)
            if not isinstance(replies[0], redis.exceptions.NoScriptError) or attempt:
                break
            self.redis.script_load(_CLAIM)  # a restarted Redis forgot it: load it, claim again
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        verdict, record = _claimed(*replies)
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


def _claimed(verdict: Any, values: Any) -> tuple[str, JobRecord]:
    """The claim's verdict and the record's CLAIM_FIELDS read after it (their values in order, None where absent)."""
    fields = {name.encode(): bytes(value) for name, value in zip(CLAIM_FIELDS, values) if value is not None}
    text = bytes(verdict).decode() if isinstance(verdict, (bytes, memoryview)) else str(verdict)
    return text, decode_record(fields) if fields else cast(JobRecord, {})
