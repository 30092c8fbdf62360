"""The service's one clock: the Redis primary's `TIME`, as each process reads it through its own monotonic clock.

Every moment a job carries (`deadline_at`, the time bill's `_at` stamps, `finished_at`) and every moment one
process judges another by (a GPU worker's heartbeat score, a held Celery message's age, a callback slot's lease)
is written by one process and read by another, often on another host. Read from each host's wall clock, a GPU
host ahead would expire jobs before inference, and a CPU host behind would bill its lag as `queue_gpu` on every
job. So no process reads its wall clock for such a moment: it reads `now()`,
the primary's clock as last measured (an NTP-style exchange, `sync`) and carried forward by this host's
monotonic clock, which no wall-clock step moves.

Why Redis's clock: it is the one every process already talks to, and the Lua steps that judge deadlines run
there. Its error against the primary is half the round trip of the best of a few `TIME` calls (well under a
millisecond on a LAN). What it does not cover: a failover to a replica whose host clock differs moves the
service's clock by that much until each process syncs again (`SYNC_EVERY_S`); keep the Redis hosts on NTP.

Each process has one clock (`CLOCK`): the offset belongs to the host it runs on, not to an object. Until it is
bound to a Redis (`follow`), `now()` is the host's wall clock. No `now()` does I/O; each process's own periodic
thread (or the CPU task, between images) calls `sync_if_due`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

SYNC_EVERY_S = 10.0  # a failover to a host with another clock is followed within this
RETRY_EVERY_S = 1.0  # after a failed sync (Redis away)
SAMPLES = 3  # TIME calls per sync; the one with the shortest round trip is kept


class ServiceClock:
    """`now()`: epoch seconds by the Redis primary's clock (see the module's note)."""

    def __init__(
        self,
        client: redis.Redis | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._monotonic = monotonic
        self._wall = wall
        self._client = client
        self._offset = wall() - monotonic()  # the host's own clock, until a sync
        self._synced = False
        self._next_sync_at = float("-inf")
        self.round_trip_s = float("nan")  # of the kept sample: the offset is within half of it
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._monotonic() + self._offset

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def offset_from_host_s(self) -> float:
        """How far the service's clock is from this host's wall clock (positive: the host is behind)."""
        return self.now() - self._wall()

    def follow(self, client: redis.Redis, sync: bool = True) -> ServiceClock:
        """Read `client`'s server from now on (a process binds its clock once it has its Redis); with `sync`, one
        sync now (a failure leaves the host's clock until the next `sync_if_due`)."""
        self._client = client
        self._next_sync_at = float("-inf")
        if sync:
            self.sync_if_due()
        return self

    def sync(self) -> bool:
        """Measure the offset again: True when it was measured (Redis answered)."""
        client = self._client
        if client is None:
            return False
        best: tuple[float, float] | None = None  # (round trip, offset)
        try:
            for _ in range(SAMPLES):
                sent = self._monotonic()
                seconds, micros = _time_reply(client.execute_command("TIME"))  # type: ignore[no-untyped-call]
                received = self._monotonic()
                sample = (received - sent, seconds + micros / 1e6 - (sent + received) / 2.0)
                if best is None or sample[0] < best[0]:
                    best = sample
        except (redis.RedisError, OSError) as exc:
            self._next_sync_at = self._monotonic() + RETRY_EVERY_S
            log.debug("service clock: no sync (%s); keeping the last offset", exc)
            return False
        assert best is not None
        with self._lock:
            moved = best[1] - self._offset
            self.round_trip_s, self._offset = best
            first, self._synced = not self._synced, True
            self._next_sync_at = self._monotonic() + SYNC_EVERY_S
        if first and abs(self.offset_from_host_s) > 1.0:
            log.warning(
                "this host's wall clock minus the service's (the Redis primary's) is %+.3f s: the service's is used",
                -self.offset_from_host_s,
                extra={"clock_offset_s": round(-self.offset_from_host_s, 3)},
            )
        elif not first and abs(moved) > 0.5:
            log.warning("the service's clock moved %.3f s (a failover to another host's clock?)", moved)
        return True

    def sync_if_due(self) -> None:
        if self._monotonic() >= self._next_sync_at:
            self.sync()


def _time_reply(reply: Any) -> tuple[int, int]:
    seconds, micros = reply
    return int(seconds), int(micros)


# The process's clock (see the module's note for why one per process).
CLOCK = ServiceClock()


# Epoch seconds by the service's clock: every moment written to Redis or compared with one read from it. The
# process clock's own method, not a function around it: the API reads it several times a request.
now = CLOCK.now
