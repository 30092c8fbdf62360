"""What a job's deadline is and how it is judged: one place for every stage that ends a job late.

A deadline is a moment on the service's clock (contract.clock): the API sets `deadline_at` to the request's
arrival plus its `deadline_ms` (or its model's default), both read on that clock, so every host judges it
alike whatever its own wall clock says. It is past once the service's clock is beyond it; nothing is judged by
a host's wall clock. Who ends a job late, and when:

- the API, when a read or a wait finds it live past its deadline (`is_past`, app.waiters);
- the CPU worker's claim (`DEADLINE_PASSED_LUA` in contract.jobs.handoff) and its waits for room or memory;
- the GPU worker's triage, before a frame takes a slot on the device;
- the step that writes an answer: one written after the deadline ends the job `expired`
  (`late_as_expired`, contract.jobs.ending);
- the sweep of the deadline index, every CPU worker's and API process's (`JobEnding.expire_overdue`), through
  `overdue_scores` (and the lost-delivery search reads the live ones through `live_scores`).

One definition of past, everywhere: the service's clock strictly beyond the deadline (`now > deadline`).
"""

from __future__ import annotations

from contract.clock import now as service_now


def deadline_at(received_at: float, deadline_ms: int) -> float:
    """The moment a job received at `received_at` (service clock) with `deadline_ms` is over."""
    return received_at + deadline_ms / 1000.0


def is_past(deadline: float, now: float | None = None) -> bool:
    """True once the service's clock (or `now`, read from it) is beyond `deadline`."""
    return (service_now() if now is None else now) > deadline


def overdue_scores(now: float) -> tuple[str, str]:
    """ZRANGEBYSCORE's bounds, over the deadline index (scores: deadlines), of the jobs past their deadline at
    `now`: scores strictly below it, as `is_past` and `deadline_passed` judge (a deadline equal to now is not
    past yet)."""
    return "-inf", f"({now!r}"


def live_scores(now: float) -> tuple[str, str]:
    """ZRANGEBYSCORE's bounds of the jobs not past their deadline at `now` (overdue_scores' complement)."""
    return repr(now), "+inf"


def seconds_left(deadline: float, now: float | None = None) -> float:
    """Seconds until `deadline` by the service's clock (negative once it passed)."""
    return deadline - (service_now() if now is None else now)


# The same judgement inside a Lua step: `now` is an ARGV the caller read from the service's clock.
DEADLINE_PASSED_LUA = """
local function deadline_passed(deadline, now)
  return deadline ~= nil and tonumber(now) > deadline
end
"""
