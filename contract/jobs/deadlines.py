"""What a job's deadline is and how it is judged (who may end a job late, and when: contract.jobs.expiry).

A deadline is a moment on the service's clock (contract.redis.clock): the API sets `deadline_at` to the request's
arrival plus its `deadline_ms` (or its model's default), both read on that clock, so every host judges it
alike whatever its own wall clock says. It is past once the service's clock is beyond it; nothing is judged by
a host's wall clock. Who ends a job late, and when, is contract.jobs.expiry's, which every such place calls (the
sweep of the deadline index reads the overdue through `overdue_scores`, the lost-delivery search the live ones
through `live_scores`).

One definition of past, everywhere: the service's clock strictly beyond the deadline (`now > deadline`).

Which deadline a job gets (the policy) is here too: its `deadline_ms` if it asked for one, at most its model's
default (`models[].default_deadline_ms`, else `jobs.default_deadline_ms`: contract.settings'
`default_deadline_ms`), else that default (`applied_deadline_ms`); the API's query model bounds `deadline_ms`
by the longest of them (`longest_deadline_ms`), before the model is known, and app.jobs applies this one.
"""

from __future__ import annotations

from collections.abc import Iterable

from contract.redis.clock import now as service_now

# A wait that ends at a deadline ends this much after it: the job it reads again is then past (a wait timed to
# the deadline itself would wake a hair before it, find the job live and go back to sleep for nothing).
PAST_BY_S = 0.05


class DeadlineTooLong(ValueError):
    """A submission's deadline_ms above its model's: `reason` says what the model allows."""

    def __init__(self, requested_ms: int, reason: str) -> None:
        super().__init__(f"deadline_ms={requested_ms}: {reason}")
        self.reason = reason


def applied_deadline_ms(requested_ms: int | None, model_default_ms: int, model_key: str) -> int:
    """The deadline a submission gets: the one it asked for, if any (DeadlineTooLong past its model's default),
    else its model's default."""
    if requested_ms and requested_ms > model_default_ms:
        raise DeadlineTooLong(requested_ms, f"at most {model_default_ms} ms for model {model_key}")
    return requested_ms or model_default_ms


def longest_deadline_ms(model_defaults_ms: Iterable[int]) -> int:
    """The bound on any submission's deadline_ms before its model is known: the longest model default."""
    return max(model_defaults_ms)


def deadline_at(received_at: float, deadline_ms: int) -> float:
    """The moment a job received at `received_at` (service clock) with `deadline_ms` is over."""
    return received_at + deadline_ms / 1000.0


def is_past(deadline: float, now: float | None = None, margin_s: float = 0.0) -> bool:
    """True once the service's clock (or `now`, read from it) is beyond `deadline`; with `margin_s`, once it is
    within that many seconds of it (a step that needs that long could no longer end in time)."""
    return (service_now() if now is None else now) > deadline - margin_s


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


# The same judgement inside a library step: deadline_passed in contract/library/deadlines.lua (`now` an argument
# the caller read from the service's clock).
