"""How jobs end, whoever ends them: the GPU worker's answer, a failure, a cancellation, an expiry.

One Lua function, the library's `finish_jobs` (contract/library/ending.lua), ends jobs in every process: the first
terminal state wins; the upload and the deadline entry go, the bytes are released (contract.admission.budget; its API
key's too), a callback enters the outbox, `job_events` is published, and a job that succeeded in time with a `cache_key`
leaves its result in the result cache (contract.cache). The steps that end jobs among other work (the GPU worker's
batch write, the API's cache hit) call it; `JobEnding` runs it alone (`finish_many`), ends the overdue ones
(`expire_overdue`, the sweeper of every CPU worker and API process) and queues an ended job's callback again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis

from contract.cache import CacheLimits
from contract.jobs.deadlines import overdue_scores
from contract.jobs.expiry import BEFORE_AN_ANSWER, expired_fields
from contract.jobs.expiry import LATE_ERROR as LATE_ERROR  # re-exported: where the steps' callers have read it
from contract.jobs.record import EXPIRED, FAILED, TERMINAL, JobStore, flatten_fields
from contract.jobs.timebill import FINISHED_AT
from contract.library import Step
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.redis.shards import BulkPlane

# A callback queued: what the step that ends a job (or a redelivery) writes as its state.
PENDING_CALLBACK = '{"status":"pending","attempts":0,"last_error":null}'

FINISH_NAMES = 7  # how many arguments JobEnding.finish_names() gives: steps find theirs after them (ending.lua's too)

# The library's `finish_jobs` (contract/library/ending.lua, where its keys and arguments are named). A facade that
# ends its own jobs calls it with JobEnding.finish_names() and ending_arguments() (contract.jobs.handoff's).
FINISH_JOBS = Step("finish_jobs")

# The library's `redeliver_callback` (contract/library/ending.lua): a callback queued again, once.
_REDELIVER_CALLBACK = Step("redeliver_callback")
REDELIVER_QUEUED, REDELIVER_IN_FLIGHT = 1, 2
# A delivery `pending` or `delivering` this long is taken for lost: only one waiting for its tenant's slots behind
# an hour of slow receivers (a few at once, each up to its timeout) is honestly that old.
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
        return FINISH_JOBS(client or self.redis, keys, args)

    def finish_names(self) -> list[Any]:
        """What the library's finish_names() reads (FINISH_NAMES of them): the record TTL, the job-events
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
        """The job keys and the arguments the library's finish_jobs() reads, for these outcomes."""
        now = service_now()
        keys: list[str] = []
        args: list[Any] = []
        for job_id, status, fields in outcomes:
            keys.append(self.job_prefix + job_id)  # named here (Keys.job_prefix)
            args += [job_id, *ending_arguments(status, fields, now)]
        return keys, args

    def fail(self, job_id: str, code: str, message: str, client: Any = None) -> bool:
        return self.finish(job_id, FAILED, {"error": {"code": code, "message": message}}, client=client)

    def expire(self, job_id: str, where: str) -> bool:
        """The job's deadline passed `where` (e.g. "before preprocessing"): it ends `expired`. Who may call it,
        and when: contract.jobs.expiry, which every caller goes through."""
        return self.finish(job_id, EXPIRED, expired_fields(where))

    def expire_overdue(self, now: float, limit: int = 500) -> int:
        """End `expired` the live jobs whose deadline passed (the deadline index says which, oldest first, at
        most `limit` a call); how many it ended. Every CPU worker calls it every `celery.sweep_s`, every API
        process on its listener's tick (both through contract.jobs.expiry.sweep): a job ends within about that of its
        deadline whether anyone reads it or not."""
        lowest, highest = overdue_scores(now)
        overdue = cast(list[bytes], self.redis.zrangebyscore(self.keys.deadlines, lowest, highest, 0, limit))
        if not overdue:
            return 0
        ids = [job_id.decode() for job_id in overdue]
        ended = int(self.finish_many([(job_id, EXPIRED, expired_fields(BEFORE_AN_ANSWER)) for job_id in ids]))
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
                    self.job_prefix + job_id,
                    self.keys.callback_outbox,
                    self.keys.callback_scheduled,
                    self.keys.callback_dead,
                ],
                [job_id, IN_FLIGHT_STALE_S, DELIVERED_COOLDOWN_S, repr(service_now())],
            )
        )


def ending_arguments(status: str, fields: Mapping[str, Any], now: float) -> list[Any]:
    """One job's arguments to the library's finish_jobs after its id: the count of its field and value arguments,
    then those (its terminal `status`, `now` as its update and its end, and `fields`)."""
    assert status in TERMINAL, status
    flat = flatten_fields({"status": status, "updated_at": now, FINISHED_AT: now, **fields})
    return [len(flat), *flat]
