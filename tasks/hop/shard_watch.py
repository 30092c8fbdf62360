"""Every CPU worker's sweep looks at the bulk shards (contract.redis.shards) and ends the jobs a shard took with it.

A shard that answers without its life token lost what it held (it restarted without its data): the jobs
that were waiting on it since before it started end `failed`, `shard_lost`. A shard unreachable past
`bulk.grace_s` ends those waiting on it, `shard_unavailable`, at every look while it stays away. Several
workers may end the same jobs: the first end wins (contract.jobs.ending), the others change nothing.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, cast

import redis

from contract.jobs.ending import JobEnding
from contract.jobs.record import FAILED, QUEUED, QUEUED_GPU
from contract.jobs.timebill import SUBMITTED_AT
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.redis.shards import SHARD_ERRORS, BulkPlane

log = logging.getLogger(__name__)

# The live jobs a shard's loss ends: their bytes wait there. A `preprocessing` job's upload is already read
# (its push to a dead shard fails it); a `running` one's frame is in a GPU worker's hands.
WAITING_ON_SHARD = frozenset({QUEUED, QUEUED_GPU})


class ShardWatch:
    """Looks at every shard; ends the jobs that waited on one that lost its data or stayed away too long."""

    def __init__(self, control: redis.Redis, bulk: BulkPlane, keys: Keys, store: JobEnding, grace_s: float) -> None:
        self.control = control
        self.bulk = bulk
        self.keys = keys
        self.store = store
        self.grace_s = grace_s
        self.seen_at: dict[int, float] = {}  # shard -> when this watch last found its life token as known

    def check(self, now: float | None = None) -> dict[int, int]:
        """One look at each shard: {shard: jobs ended} for the shards whose jobs it ended."""
        if not self.bulk.sharded:
            return {}
        now = service_now() if now is None else now
        ended = {}
        for index, client in enumerate(self.bulk.clients):
            count = self._check_one(index, client, now)
            if count:
                ended[index] = count
        return ended

    def _check_one(self, index: int, client: redis.Redis, now: float) -> int:
        try:
            life, restarted_at = self._life(client, now)
        except SHARD_ERRORS:
            self.bulk.mark_down(index)
            self.control.hsetnx(self.keys.bulk_down, str(index), repr(now))
            since = float(cast(bytes, self.control.hget(self.keys.bulk_down, str(index))) or now)
            if now - since < self.grace_s:
                return 0
            return self._end_jobs_of(
                index,
                "shard_unavailable",
                f"the Redis shard holding its bytes "
                f"(bulk.redis_urls[{index}]) has been unreachable for over {self.grace_s:g} s",
                before=now,
            )
        self.control.hdel(self.keys.bulk_down, str(index))
        known = self.control.hget(self.keys.bulk_lives, str(index))
        self.control.hset(self.keys.bulk_lives, str(index), life)
        seen_at = self.seen_at.get(index)
        self.seen_at[index] = now
        if known is None or known == life:
            return 0
        lost_at = self.lost_at(seen_at, restarted_at, now)
        log.error("bulk shard %d lost its data (by %.3f)", index, lost_at)
        return self._end_jobs_of(
            index,
            "shard_lost",
            f"the Redis shard holding its bytes (bulk.redis_urls[{index}]) lost its data (it restarted without it)",
            before=lost_at,
        )

    @staticmethod
    def lost_at(seen_at: float | None, restarted_at: float, now: float) -> float:
        """When a shard found with a new life token lost its data: the jobs sent to it before then are gone.
        `restarted_at` is a second or two before its server really started (its uptime is whole seconds).
        Restarted since this watch last saw it whole (`seen_at`), or first seen by this watch: at its restart.
        Restarted within a second of that last look (the margin puts `restarted_at` before it): at the look, as
        the server can only have started after it (dating it `now`, as before, failed the jobs the API had put
        on the new server since: `tests/test_shards.py` met it). Not restarted (emptied while it ran): at some
        moment before now."""
        if seen_at is None or restarted_at > seen_at:
            return restarted_at
        if restarted_at > seen_at - 1.0:
            return seen_at
        return now

    def _life(self, client: redis.Redis, now: float) -> tuple[bytes, float]:
        """The shard's life token (written when first seen without one) and when its server started."""
        uptime = float(cast(dict[str, Any], client.info("server"))["uptime_in_seconds"])
        client.set(self.keys.bulk_life, uuid.uuid4().hex, nx=True)
        life = cast(bytes | None, client.get(self.keys.bulk_life))
        return life or b"", now - uptime - 1.0  # uptime is whole seconds: a second's margin

    def _end_jobs_of(self, index: int, code: str, message: str, before: float) -> int:
        """End `failed` the live jobs of this shard waiting on it (WAITING_ON_SHARD) that reached it before
        `before` (epoch seconds)."""
        live = [raw.decode() for raw in cast(list[bytes], self.control.zrange(self.keys.deadlines, 0, -1))]
        mine = [job_id for job_id in live if self.bulk.index(job_id) == index]
        if not mine:
            return 0
        pipe = self.control.pipeline(transaction=False)
        for job_id in mine:
            pipe.hmget(self.keys.job(job_id), "status", SUBMITTED_AT)
        doomed = []
        for job_id, (status, submitted) in zip(mine, pipe.execute()):
            if status is not None and status.decode() in WAITING_ON_SHARD and float(submitted or 0) < before:
                doomed.append((job_id, FAILED, {"error": {"code": code, "message": message}}))
        ended = 0
        for start in range(0, len(doomed), 500):
            ended += int(self.store.finish_many(doomed[start : start + 500]))
        if ended:
            log.error("ended %d jobs of bulk shard %d: %s", ended, index, code)
        return ended
