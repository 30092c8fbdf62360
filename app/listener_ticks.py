"""What a cell's long-poll listener runs on its tick (app.waiters.JobEventListener's `on_tick`, after every event
and at least each second): the clock's measure, the deadline sweep, idle connections closed."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from contract.admission.budget import WaitingBytes
from contract.jobs import expiry
from contract.jobs.intake import JobIntake
from contract.redis.clock import now as service_now
from contract.redis.connection import close_idle_connections

SWEEP_EVERY_S = 1.0
# A connection left unused in its pool this long is closed (it reopens when needed): what a burst opened goes.
REDIS_IDLE_S = 60.0
IDLE_CHECK_EVERY_S = 10.0


def ticks(*each_tick: Callable[[], None]) -> Callable[[], None]:
    def tick() -> None:
        for each in each_tick:
            each()

    return tick


def idle_closer(clients: list[redis.Redis]) -> Callable[[], None]:
    """The listener's tick: close the connections idle past REDIS_IDLE_S, looked for every IDLE_CHECK_EVERY_S."""
    last = [time.monotonic()]
    distinct = list({id(client.connection_pool): client for client in clients}.values())  # bulk may be the control

    def close_idle() -> None:
        now = time.monotonic()
        if now - last[0] < IDLE_CHECK_EVERY_S:
            return
        last[0] = now
        for client in distinct:
            close_idle_connections(client, REDIS_IDLE_S)

    return close_idle


def sweeper(store: JobIntake, waiting: WaitingBytes) -> Callable[[], None]:
    """The listener's tick: end overdue jobs, give back the bytes a refused submission could not (Redis
    was away) and add this process's cache misses to the shared counters, at most once a second."""
    last = [0.0]

    def sweep() -> None:
        now = service_now()
        if now - last[0] < SWEEP_EVERY_S:
            return
        last[0] = now
        try:
            expiry.sweep(store, now)
            waiting.flush_unreleased()
            store.flush_counts()
        except redis.RedisError:
            pass  # the listener has lost Redis too, and says so

    return sweep
