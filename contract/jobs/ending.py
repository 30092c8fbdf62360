"""How jobs end, whoever ends them: the GPU worker's answer, a failure, a cancellation, an expiry.

One Lua function, FINISH_JOBS_LUA's `finish_jobs`, ends jobs in every process: the first terminal state wins; the
upload and the deadline entry go, the bytes are released (contract.budget; its API key's too), a callback enters the
outbox, `job_events` is published, and a job that succeeded in time with a `cache_key` leaves its result in the result
cache (contract.cache). Scripts that end jobs among other work (the GPU worker's batch write, the API's cache
hit: contract.jobs.intake) start with it; `JobEnding` runs it alone (`finish_many`), ends the overdue ones
(`expire_overdue`, the sweeper of every CPU worker and API process) and queues an ended job's callback again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis

from contract.budget import RELEASE_LUA
from contract.cache import REMEMBER_LUA, CacheLimits
from contract.clock import now as service_now
from contract.deadlines import DEADLINE_PASSED_LUA, overdue_scores
from contract.jobs.record import EXPIRED, FAILED, TERMINAL, TERMINAL_LUA, JobStatus, JobStore, flatten_fields
from contract.keys import UPLOAD_SUFFIX, Keys
from contract.library import Step
from contract.shards import BulkPlane
from contract.timebill import FINISHED_AT

# A callback queued: what the step that ends a job (or a redelivery) writes as its state.
PENDING_CALLBACK = '{"status":"pending","attempts":0,"last_error":null}'

# What a job answered after its deadline carries instead of its result (the answer came too late to stand).
LATE_ERROR = '{"code":"deadline","message":"expired: its answer came after the deadline"}'

FINISH_NAMES = 7  # how many arguments JobEnding.finish_names() gives: scripts find theirs after them

# A Lua function that ends each live job whose hash is in KEYS[first_key..], with its arguments from
# ARGV[at..]: per job its id, the count of field and value arguments, the fields and values (the
# first terminal state wins). A job with a callback_url enters the outbox in the same atomic step
# that ends it: once per terminal state, whoever ends it. An answer written after the job's deadline
# does not stand: the job ends `expired` instead (its result is dropped; a long-poll was told at the
# deadline). The job leaves the deadline index (`deadlines`, a sorted set) in the same step, and a job that
# succeeded with a `cache_key` leaves its result in the result cache (contract.cache). Returns how many jobs it
# ended. Scripts that end jobs among other work (the GPU worker's batch write) start with it.
FINISH_JOBS_LUA = (
    TERMINAL_LUA
    + DEADLINE_PASSED_LUA
    + RELEASE_LUA
    + REMEMBER_LUA
    + f"""local UPLOAD_SUFFIX = '{UPLOAD_SUFFIX}'
local PENDING_CALLBACK = '{PENDING_CALLBACK}'
local LATE_ERROR = '{LATE_ERROR}'
local SUCCEEDED, EXPIRED = '{JobStatus.SUCCEEDED.value}', '{JobStatus.EXPIRED.value}'
-- A job in these has no upload left: the push took it in the step that moved the job on (contract.frame_push; over
-- bulk shards, a frame taken before that step ran finds the job over, and the step gives the upload's bytes back).
local PUSHED = {{['{JobStatus.QUEUED_GPU.value}'] = true, ['{JobStatus.RUNNING.value}'] = true}}
"""
    + """
-- The fields written, as written: an answer that came after the job's deadline ends it `expired` instead, without
-- its result. Returns the fields to write and the status and result they end the job with.
local function late_as_expired(deadline, fields)
  local status, finished, result
  for i = 1, #fields, 2 do
    if fields[i] == 'status' then status = i elseif fields[i] == 'finished_at' then finished = i
    elseif fields[i] == 'result' then result = i end
  end
  local ends_as = status and fields[status + 1]
  if ends_as ~= SUCCEEDED or not finished or not deadline_passed(deadline, fields[finished + 1]) then
    return fields, ends_as, result and fields[result + 1], finished and fields[finished + 1]
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
  return kept, EXPIRED, nil, nil
end

-- The names finish_jobs needs, from the FINISH_NAMES arguments at ARGV[i..] (JobEnding.finish_names).
local function finish_names(outbox, i)
  return {outbox = outbox, ttl = tonumber(ARGV[i]), channel = ARGV[i + 1], deadlines = ARGV[i + 2],
          waiting = ARGV[i + 3], cache = cache_names(i + 4)}
end

-- What of a record ending it reads, in one HMGET (not one read a field: every command inside a script is one
-- more for Redis's only thread, per job).
local READ_AT_END = {'status', 'deadline_at', 'model', 'bytes', 'cache_key', 'callback_url'}

local function finish_jobs(names, first_key, at)
  local ended, left, entries, called, released, by_owner = 0, {}, {}, {}, {}, {}
  for k = first_key, #KEYS do
    local key, job_id, count = KEYS[k], ARGV[at], tonumber(ARGV[at + 1])
    local was = redis.call('HMGET', key, unpack(READ_AT_END))
    local status = was[1]
    if status and not TERMINAL[status] then
      local fields, ends_as, result, finished = late_as_expired(tonumber(was[2]),
                                                                {unpack(ARGV, at + 2, at + 1 + count)})
      if was[6] then   -- its callback enters the outbox (below), in the same write
        fields[#fields + 1] = 'callback'
        fields[#fields + 1] = PENDING_CALLBACK
        called[#called + 1] = job_id
      end
      redis.call('HSET', key, unpack(fields))
      -- a record made with a deadline lives until jobs.ttl_s past it (JobIntake.create): no TTL to set again
      if not was[2] then redis.call('EXPIRE', key, names.ttl) end
      if ends_as == SUCCEEDED and was[5] and result then entries[#entries + 1] = {was[5], result, finished} end
      -- whatever ended it, its upload goes with it (no DEL an image where the push took it)
      if not PUSHED[status] and redis.call('DEL', key .. UPLOAD_SUFFIX) == 1 then
        local model, bytes = was[3] or '', tonumber(was[4]) or 0
        if bytes > 0 then released[model] = (released[model] or 0) + bytes end
        -- its API key's share of the budgets (contract.budget), read only here: a job whose frame was pushed (a
        -- batch's) has no upload left, and its end reads no more than before
        local owner = bytes > 0 and redis.call('HGET', key, 'owner')
        if owner and owner ~= '' then
          local mine = by_owner[owner] or {}
          by_owner[owner], mine[model] = mine, (mine[model] or 0) + bytes
        end
      end
      left[#left + 1] = job_id
      ended = ended + 1
    end
    at = at + 2 + count
  end
  if #left > 0 then   -- one call each for all of them: a batch's ends wake long-polls with one message
    redis.call('ZREM', names.deadlines, unpack(left))
    redis.call('PUBLISH', names.channel, table.concat(left, ' '))
  end
  if #called > 0 then   -- the PUBLISH wakes the callback relays (its channel is named as the outbox; they read
    redis.call('RPUSH', names.outbox, unpack(called))   -- the outbox, not the message)
    redis.call('PUBLISH', names.outbox, table.concat(called, ' '))
  end
  release_each(names.waiting, released)
  release_owners(names.waiting, by_owner)
  remember_all(names.cache, entries)
  return ended
end
"""
)

# The library's `finish_jobs` (contract/library/ending.lua, where its keys and arguments are named).
_FINISH_JOBS = Step("finish_jobs")

# The library's `redeliver_callback` (contract/library/ending.lua): a callback queued again, once.
_REDELIVER_CALLBACK = Step("redeliver_callback")
REDELIVER_QUEUED, REDELIVER_IN_FLIGHT = 1, 2
# A delivery `pending` or `delivering` this long is taken for lost: one waiting for its tenant's slots behind
# an hour of slow receivers (4 at once, 10 s each: 1,440 attempts) is the only honest one that old.
IN_FLIGHT_STALE_S = 3600
# A delivery made this recently answers a redelivery request for it: its receiver has it, or lost it a moment ago.
DELIVERED_COOLDOWN_S = 10


class JobEnding(JobStore):
    """The job records, and the steps that end jobs."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        ttl_s: int,
        bulk: BulkPlane | None = None,
        cache: CacheLimits | None = None,
        results_as_text: bool = False,
    ) -> None:
        """`cache`: where jobs this ends `succeeded` leave their results (the GPU worker's); None: nowhere.
        `results_as_text`: as JobStore's."""
        super().__init__(client, keys, ttl_s, bulk, results_as_text)
        self.cache = cache or CacheLimits(keys.cache_prefix)

    def finish(self, job_id: str, status: str, fields: Mapping[str, Any] | None = None, client: Any = None) -> bool:
        """End a job once; the first terminal state wins and wakes its long-polls."""
        return bool(self.finish_many([(job_id, status, fields or {})], client))

    def finish_many(self, outcomes: Sequence[tuple[str, str, Mapping[str, Any]]], client: Any = None) -> Any:
        """End each (job id, terminal status, fields) that is still live, in one step: how many it
        ended (in a pipeline, with the pipeline's replies)."""
        job_keys, job_args = self.finish_arguments(outcomes)
        keys, args = [self.keys.callback_outbox, *job_keys], [*self.finish_names(), *job_args]
        return _FINISH_JOBS(client or self.redis, keys, args)

    def finish_names(self) -> list[Any]:
        """What FINISH_JOBS_LUA's finish_names() reads (FINISH_NAMES of them): the record TTL, the job-events
        channel, the deadline index, the waiting-bytes hash and the result cache's names."""
        names = [
            self.ttl_s,
            self.keys.job_events,
            self.keys.deadlines,
            self.keys.waiting_bytes,
            *self.cache.finish_names(),
        ]
        assert len(names) == FINISH_NAMES
        return names

    def finish_arguments(self, outcomes: Sequence[tuple[str, str, Mapping[str, Any]]]) -> tuple[list[str], list[Any]]:
        """The job keys and the arguments FINISH_JOBS_LUA's finish_jobs() reads, for these outcomes."""
        now = service_now()
        keys: list[str] = []
        args: list[Any] = []
        for job_id, status, fields in outcomes:
            assert status in TERMINAL, status
            flat = flatten_fields({"status": status, "updated_at": now, FINISHED_AT: now, **fields})
            keys.append(self.keys.job(job_id))
            args += [job_id, len(flat), *flat]
        return keys, args

    def fail(self, job_id: str, code: str, message: str, client: Any = None) -> bool:
        return self.finish(job_id, FAILED, {"error": {"code": code, "message": message}}, client=client)

    def expire(self, job_id: str, where: str) -> bool:
        """The job's deadline passed `where` (e.g. "before preprocessing"): it ends `expired`."""
        return self.finish(job_id, EXPIRED, expired_fields(where))

    def expire_overdue(self, now: float, limit: int = 500) -> int:
        """End `expired` the live jobs whose deadline passed (the deadline index says which, oldest first, at
        most `limit` a call); how many it ended. Every CPU worker calls it every `celery.sweep_s`: a job
        ends within about that of its deadline whether anyone reads it or not."""
        lowest, highest = overdue_scores(now)
        overdue = cast(list[bytes], self.redis.zrangebyscore(self.keys.deadlines, lowest, highest, 0, limit))
        if not overdue:
            return 0
        ids = [job_id.decode() for job_id in overdue]
        ended = int(
            self.finish_many([(job_id, EXPIRED, expired_fields("before an answer was written")) for job_id in ids])
        )
        self.redis.zrem(self.keys.deadlines, *ids)  # those that had ended otherwise, or whose record expired
        return ended

    def redeliver_callback(self, job_id: str) -> int:
        """Queue an ended job's callback again from its first attempt (a dead letter, or a delivery the receiver
        lost): REDELIVER_QUEUED; REDELIVER_IN_FLIGHT when one is queued or under way already, or was delivered
        less than DELIVERED_COOLDOWN_S ago (nothing queued); 0 when the job does not exist, has not ended or has
        no callback."""
        return int(
            _REDELIVER_CALLBACK(
                self.redis,
                [
                    self.keys.job(job_id),
                    self.keys.callback_outbox,
                    self.keys.callback_scheduled,
                    self.keys.callback_dead,
                ],
                [job_id, IN_FLIGHT_STALE_S, DELIVERED_COOLDOWN_S, repr(service_now())],
            )
        )


def expired_fields(where: str) -> dict[str, Any]:
    """What an expired job carries: one error code, `deadline`, and where the deadline passed."""
    return {"error": {"code": "deadline", "message": f"expired {where}"}}
