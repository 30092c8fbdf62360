"""The bulk plane: where a job's upload and frame live, on the control Redis or spread over shards.

With no `bulk.redis_urls`, uploads and frames lie in the Redis of `redis_url` beside everything else, and
every step is as it always was (one Redis, one transaction per move). With shards listed, a job's upload and
frame lie on one shard, `shard_of(job id)`: every process computes it the same way from the id alone, so
nothing has to be looked up, and the API picks ids whose shard is up (`BulkPlane.new_job_id`). The job
record, Celery, the budgets and everything else stay on the control plane; the job record carries a marker
where the upload was (`SHARDED_UPLOAD` in its `UPLOAD_FIELD`), which the steps on job records read.

What a shard's failure does (docs/reliability.md, "A bulk shard dies"): the processes skip a shard they
found down for `bulk.retry_s`; `tasks.hop.shard_watch` (every CPU worker's sweep) ends `failed` the live jobs that were
waiting on a shard which lost its data (`shard_lost`) or stayed unreachable past `bulk.grace_s`
(`shard_unavailable`). Jobs on other shards go on.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Sequence

import redis

from contract.redis.connection import connect
from contract.redis.keys import Keys
from contract.settings import Settings

SHARDED_UPLOAD = b"@shard"  # the control plane's stand-in for an upload that lies on the job's shard
# Where the stand-in lies: a field of the job record (the intake's HSET writes it, the push's HSET clears it to '',
# an end clears it), not a key of its own: the marker's SET and the push's DEL were two commands an image more.
# The steps still read a marker key (Keys.upload) for a record without the field, one an older API stored.
UPLOAD_FIELD = "upload"
SHARD_ERRORS = (redis.ConnectionError, redis.TimeoutError)
SHARD_SOCKET_TIMEOUT_S = 2.0  # a shard that does not answer in this is treated as down


class ShardUnavailable(redis.ConnectionError):
    """The job's shard did not answer. Its text names the shard by its place in the settings only: it ends up
    in a job's error, which clients read (the cause, with the address, stays in `__cause__` for the logs)."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(f"the Redis shard holding this job's bytes (bulk.redis_urls[{index}]) did not answer")
        self.index = index
        self.cause = cause


def shard_of(job_id: str, count: int) -> int:
    """The shard a job's upload and frame live on: CRC-32 of its id, modulo the shards (ids are random)."""
    return zlib.crc32(job_id.encode()) % count if count > 1 else 0


class BulkPlane:
    """The bulk plane as one process sees it: its clients, the placement rule, which shards it found down."""

    def __init__(
        self,
        control: redis.Redis,
        shards: Sequence[redis.Redis] = (),
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if retry_s <= 0:
            raise ValueError(f"retry_s must be > 0, got {retry_s}")
        self.sharded = bool(shards)
        self.clients: list[redis.Redis] = list(shards) if shards else [control]
        self.retry_s = retry_s
        self.clock = clock
        self._down_until = [0.0] * len(self.clients)

    @property
    def count(self) -> int:
        return len(self.clients)

    def index(self, job_id: str) -> int:
        return shard_of(job_id, self.count)

    def client_for(self, job_id: str) -> redis.Redis:
        return self.clients[self.index(job_id)]

    def frame_bound(self, max_frames: int) -> int:
        """A model's frame list bound on one shard: its share of `max_frames` (all shards: at most
        max_frames + shards - 1)."""
        return max(1, math.ceil(max_frames / self.count))

    def mark_down(self, index: int) -> None:
        if self.sharded:
            self._down_until[index] = self.clock() + self.retry_s

    def is_up(self, index: int) -> bool:
        return self._down_until[index] <= self.clock()

    def new_job_id(self, draw: Callable[[], str]) -> str:
        """A new job id whose shard this process has not found down lately (any id when all are)."""
        job_id = draw()
        for _ in range(8 * self.count if self.sharded else 0):
            if self.is_up(self.index(job_id)):
                break
            job_id = draw()
        return job_id

    def frames_waiting(self, keys: Keys, model_keys: Sequence[str]) -> dict[str, int]:
        """Per model, its frames over every shard that answers (one round trip per shard)."""
        totals = dict.fromkeys(model_keys, 0)
        for index, client in enumerate(self.clients):
            if not self.is_up(index):
                continue
            pipe = client.pipeline(transaction=False)
            for model_key in model_keys:
                pipe.llen(keys.frames(model_key))
            try:
                depths = pipe.execute()
            except SHARD_ERRORS:
                self.mark_down(index)
                continue
            for model_key, depth in zip(model_keys, depths):
                totals[model_key] += int(depth)
        return totals


def connect_shards(
    settings: Settings, socket_timeout: float | None = SHARD_SOCKET_TIMEOUT_S, max_connections: int | None = None
) -> list[redis.Redis]:
    """A client per bulk shard (none without shards)."""
    return [
        connect(settings, socket_timeout=socket_timeout, max_connections=max_connections, url=url)
        for url in settings.bulk.redis_urls
    ]


def bulk_plane(
    settings: Settings,
    control: redis.Redis,
    socket_timeout: float | None = SHARD_SOCKET_TIMEOUT_S,
    max_connections: int | None = None,
) -> BulkPlane:
    return BulkPlane(control, connect_shards(settings, socket_timeout, max_connections), settings.bulk.retry_s)
