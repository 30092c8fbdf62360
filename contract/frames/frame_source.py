"""The frame list, out: a GPU worker's pops, its ack, give back and requeue (contract.frames is the frame itself).

Frames move, never vanish: BLMOVE/LMOVE carry each frame from the model's list into the worker's processing list,
and only its ack (the library's `ack_frames`, the one place a frame is acked) removes them once their results are
written; a worker that dies leaves its frames there, and `requeue_frames_of` gives them back. The processing list is
in the order the frames were taken: the newest at the left, the oldest at the right. The worker answers its batches in
the order it took them, so a batch's frames are always the rightmost ones when it is acked, and the ack drops them
by count, without sending them back over the wire. After an error that may have left the worker unsure what it
holds (a Redis call that failed half way), it answers what it has in hand, then gives back whatever is left in
the list (`requeue_frames_of`): the order holds again.

With bulk shards (contract.redis.shards) the same moves are contract.frames.frame_shard_source's: a list per shard, each
one this module's RedisFrameSource; `requeue_frames_of` gives a dead worker's frames back on each.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol, TypeVar

import redis

from contract.library import Step
from contract.redis.keys import Keys
from contract.redis.replies import PayloadReader
from contract.redis.shards import SHARD_ERRORS, BulkPlane

log = logging.getLogger(__name__)

# The frame list's ack, the one place a frame is acked: the library's ack_frames (contract/library/frames.lua) drops
# the `count` oldest frames of a processing list (the batch just answered: see the module's note). The GPU worker's
# batch write (gpu_worker.finish) acks in the same atomic step as the results it writes; a source's `ack` runs the
# step `ack_frames` alone.
_ACK_FRAMES = Step("ack_frames")

Popped = TypeVar("Popped")


class FrameSource(Protocol[Popped]):
    """What a GPU worker's lane takes frames from and answers them to: RedisFrameSource, or ShardedFrameSource
    (contract.frames.frame_shard_source); the batcher (gpu_worker.batcher) uses the two pops. A frame is a memoryview
    there; generic so that the batcher's tests can pop anything."""

    acked_by_batch_write: bool  # the batch write acks (the library's ack_frames) itself, else `ack` does, after it

    def pop_blocking(self, timeout_s: float) -> Popped | None: ...
    def pop_available(self, limit: int) -> Sequence[Popped]: ...
    def ack(self, count: int) -> None: ...
    def give_back(self, frames: Sequence[Popped]) -> None: ...
    def forget(self) -> None: ...


class RedisFrameSource:
    """One model's frame list, and this worker's processing list for it."""

    acked_by_batch_write = (
        True  # the Finisher's one write acks (the library's ack_frames); alone (a tool, a shard): `ack`
    )

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, model_key: str) -> None:
        self.redis = client
        self.frames_key = keys.frames(model_key)
        self.processing_key = keys.processing(worker_id, model_key)
        self.reader = PayloadReader(client)  # frames are read straight into one buffer each

    def pop_blocking(self, timeout_s: float) -> memoryview | None:
        # Oldest frame is at the right (producers LPUSH): FIFO.
        return self.reader.bulks(("BLMOVE", self.frames_key, self.processing_key, "RIGHT", "LEFT", timeout_s))[0]

    def pop_available(self, limit: int) -> list[memoryview]:
        """Up to `limit` frames, oldest first, in one round trip. Not a Lua script: a script that
        returns frames makes Redis copy each one into the script and again into the reply, several
        times the server CPU of LMOVE (docs/benchmarks/2026-12-02-feeding-a-fast-gpu.md)."""
        if limit <= 0:
            return []
        move = ("LMOVE", self.frames_key, self.processing_key, "RIGHT", "LEFT")
        return [frame for frame in self.reader.bulks(*[move] * limit) if frame is not None]

    def ack(self, count: int, uploads: Sequence[str] = ()) -> None:
        """Drop the `count` oldest frames in hand, the batch just answered, and `uploads` (the library's ack_frames)."""
        if count > 0:
            _ACK_FRAMES(self.redis, [self.processing_key, *uploads], [count])

    def give_back(self, frames: Sequence[memoryview]) -> None:
        """The oldest frames in hand (these, in order) back to the front of the list, in one step."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(self.frames_key, *reversed(frames))
        pipe.ltrim(self.processing_key, 0, -(len(frames) + 1))
        pipe.execute()

    def forget(self) -> None:
        """Nothing to forget: what is in hand is in the processing list alone."""


# Giving a worker's unanswered frames back, on the control plane and wherever its lists lie (the control plane itself,
# or each bulk shard: contract.redis.shards), in three steps: the fence, the move, the count.
# The library's `fence_worker`, `move_frames_back` and `count_attempts` (contract/library/frames.lua).
_FENCE, _MOVE_BACK, _COUNT_ATTEMPTS = Step("fence_worker"), Step("move_frames_back"), Step("count_attempts")


def requeue_frames_of(
    client: redis.Redis,
    keys: Keys,
    worker_id: str,
    model_keys: Sequence[str],
    only_if_dead: bool,
    count_attempt: bool = True,
    bulk: BulkPlane | None = None,
) -> int:
    """Move `worker_id`'s processing lists of these models back to the models' frame lists: fenced on the control
    plane (`client`), moved on each server the lists lie on (`bulk`'s shards; without, the control plane), one
    attempt counted on each job when `count_attempt` (the worker died holding them). -1 if it turned out alive.
    A shard that does not answer keeps its part: the worker stays in the registry (when reaping), so the next
    reaper tries again."""
    bulk = bulk or BulkPlane(client)
    heartbeat = keys.heartbeat(worker_id) if only_if_dead else ""
    if int(_FENCE(client, [heartbeat, keys.gpu_epoch(worker_id)], [])) == -1:
        return -1
    moved: list[str] = []
    complete = True
    for index, server in enumerate(bulk.clients):
        try:
            moved += move_back(server, keys, worker_id, model_keys)
        except SHARD_ERRORS as exc:
            if not bulk.sharded:
                raise
            bulk.mark_down(index)
            complete = False
            log.warning("could not give back %s's frames on bulk shard %d: %s", worker_id, index, exc)
    counted = [keys.job(job_id) for job_id in moved if job_id]
    if count_attempt and counted:
        _COUNT_ATTEMPTS(client, counted, [])
    if only_if_dead and complete:
        client.zrem(keys.gpu_workers, worker_id)
    return len(moved)


def move_back(server: redis.Redis, keys: Keys, worker_id: str, model_keys: Sequence[str]) -> list[str]:
    """This worker's processing lists on one server back to their frame lists (no attempt counted): the job ids of
    the frames moved ('' for a frame without one)."""
    lists = [key for model_key in model_keys for key in (keys.processing(worker_id, model_key), keys.frames(model_key))]
    return [raw.decode() for raw in _MOVE_BACK(server, lists, [])]
