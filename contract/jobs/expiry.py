"""Expiry in one home: who may end a job `expired`, and when (every place that does calls this module).

When: once the service's clock is strictly beyond the job's `deadline_at` (`is_late`: contract.jobs.deadlines'
`is_past`, the one definition of past), or within `margin_s` of it for a step that needs that long and could no
longer end in time. A step of the library judges the same with `deadline_passed` (contract/library/deadlines.lua),
`now` an argument its caller read from the service's clock.

Who: any process that finds a live job late, through the step that ends jobs (contract.jobs.ending's `finish`:
the first end wins), so an expiry never replaces another end and an end after it changes nothing. Each:

- a read or a wait of the API that finds the job live past its deadline (app.waiters): `expire_if_late`;
- the sweep of the deadline index, every API process's tick (app.listener_ticks) and every CPU worker's
  (tasks.hop.job_sweeps), for the jobs nobody reads: `sweep`;
- the CPU worker's claim, whose step answers `late` without changing the job (the library's `claim`, by
  `deadline_passed`); the worker then ends it through its hand-off (contract.jobs.handoff's `expire_late`:
  `expired_fields(BEFORE_PREPROCESSING)`);
- the CPU worker's waits for room on the frame list and for memory (with a margin): `expire_if_late`;
- the GPU worker's triage, before a frame takes a slot on the device: `is_late`, and the batch's ends carry
  `expired_fields(BEFORE_INFERENCE)`;
- the step that writes an answer: one written after the deadline ends the job `expired` without its result
  (the library's `late_as_expired`, contract/library/deadlines.lua, which the batch write and every end call).
"""

from __future__ import annotations

from typing import Any, Protocol

from contract.jobs.deadlines import is_past
from contract.jobs.record import EXPIRED


class EndsJobs(Protocol):
    """What expiry needs of contract.jobs.ending's JobEnding (which reads this module's literals: no import back)."""

    def finish(self, job_id: str, status: str, fields: dict[str, Any]) -> bool: ...

    def expire_overdue(self, now: float, limit: int = 500) -> int: ...


# What a job answered after its deadline carries instead of its result (the answer came too late to stand): the
# library's `late_as_expired` writes it (contract/library/deadlines.lua holds the same text; a test holds them
# together).
LATE_ERROR = '{"code":"deadline","message":"expired: its answer came after the deadline"}'

# Where the deadline passed, as an expired job's error message says it ("expired <where>").
BEFORE_AN_ANSWER = "before an answer was written"  # a read, a wait or the sweep found it live
BEFORE_PREPROCESSING = "before preprocessing"  # the claim
WAITING_FOR_ROOM = "waiting for room on the GPU list"
WHILE_STORE_FULL = "while the job store was full"
BEFORE_INFERENCE = "before inference"  # the GPU worker's triage


def is_late(deadline: float, now: float | None = None, margin_s: float = 0.0) -> bool:
    """Whether a job with `deadline` may be ended `expired` now (or at `now`): the service's clock beyond it, or
    within `margin_s` of it."""
    return is_past(deadline, now, margin_s)


def expired_fields(where: str) -> dict[str, Any]:
    """What an expired job carries: one error code, `deadline`, and where the deadline passed."""
    return {"error": {"code": "deadline", "message": f"expired {where}"}}


def expire(store: EndsJobs, job_id: str, where: str) -> bool:
    """End the job `expired` (its deadline passed `where`) unless something ended it first: whether this did."""
    return store.finish(job_id, EXPIRED, expired_fields(where))


def expire_if_late(
    store: EndsJobs, job_id: str, deadline: float, where: str, margin_s: float = 0.0, now: float | None = None
) -> bool:
    """End the job `expired` if it is late (`is_late`): whether it was late (it is over then, however it ended)."""
    if not is_late(deadline, now, margin_s):
        return False
    expire(store, job_id, where)
    return True


def sweep(store: EndsJobs, now: float, limit: int = 500) -> int:
    """End `expired` the live jobs the deadline index holds past their deadline at `now` (oldest first, at most
    `limit`): how many this ended (JobEnding.expire_overdue: one step for them all)."""
    return store.expire_overdue(now, limit)
