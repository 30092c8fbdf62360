"""The frame list, out: a GPU worker's pops, its ack, give back and requeue (contract.frames is the frame itself).

Frames move, never vanish: BLMOVE/LMOVE carry each frame from the model's list into the worker's processing list,
and only its ack (`ACK_FRAMES_LUA`, the one place a frame is acked) removes them once their results are written; a
worker that dies leaves its frames there, and `requeue_frames_of` gives them back. The processing list is in the
order the frames were taken: the newest at the left, the oldest at the right. The worker answers its batches in
the order it took them, so a batch's frames are always the rightmost ones when it is acked, and the ack drops them
by count, without sending them back over the wire. After an error that may have left the worker unsure what it
holds (a Redis call that failed half way), it answers what it has in hand, then gives back whatever is left in
the list (`requeue_frames_of`): the order holds again.

With bulk shards (contract.shards) the same moves are contract.frame_shard_source's: a list per shard, each one
this module's RedisFrameSource; `requeue_frames_of` gives a dead worker's frames back on each.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol, TypeVar

import redis

from contract.frames import FRAME_JOB_ID_LUA
from contract.keys import Keys
from contract.replies import PayloadReader
from contract.shards import SHARD_ERRORS, BulkPlane

log = logging.getLogger(__name__)

# The frame list's ack, the one place a frame is acked: drop the `count` oldest frames of a processing list (the
# batch just answered: see the module's note). A Lua function, so that the GPU worker's batch write
# (gpu_worker.finish) acks in the same atomic step as the results it writes; a source's `ack` runs it alone.
ACK_FRAMES_LUA = """
local function ack_frames(processing, count)
  if count > 0 then redis.call('LTRIM', processing, 0, -(count + 1)) end
end
"""

# The ack alone: KEYS[1] the processing list, KEYS[2..] uploads that waited for these frames (bulk shards keep a
# job's bytes until its frame is acked: contract.frame_shard_source); ARGV[1] the count.
_ACK_FRAMES = (
    ACK_FRAMES_LUA
    + """
ack_frames(KEYS[1], tonumber(ARGV[1]))
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""
)

Popped = TypeVar("Popped")


class FrameSource(Protocol[Popped]):
    """What a GPU worker's lane takes frames from and answers them to: RedisFrameSource, or ShardedFrameSource
    (contract.frame_shard_source); the batcher (gpu_worker.batcher) uses the two pops. A frame is a memoryview there;
    generic so that the batcher's tests can pop anything."""

    acked_by_batch_write: bool  # the batch write acks (ACK_FRAMES_LUA) itself, else `ack` does, after it

    def pop_blocking(self, timeout_s: float) -> Popped | None: ...
    def pop_available(self, limit: int) -> Sequence[Popped]: ...
    def ack(self, count: int) -> None: ...
    def give_back(self, frames: Sequence[Popped]) -> None: ...
    def forget(self) -> None: ...


class RedisFrameSource:
    """One model's frame list, and this worker's processing list for it."""

    acked_by_batch_write = True  # the Finisher's one write acks (ACK_FRAMES_LUA); alone (a tool, a shard): `ack`

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, model_key: str) -> None:
        self.redis = client
        self.frames_key = keys.frames(model_key)
        self.processing_key = keys.processing(worker_id, model_key)
        self.reader = PayloadReader(client)  # frames are read straight into one buffer each
        self._ack = client.register_script(_ACK_FRAMES)

    def pop_blocking(self, timeout_s: float) -> memoryview | None:
        # Oldest frame is at the right (producers LPUSH): FIFO.
        return self.reader.bulks(("BLMOVE", self.frames_key, self.processing_key, "RIGHT", "LEFT", timeout_s))[0]

    def pop_available(self, limit: int) -> list[memoryview]:
        """Up to `limit` frames, oldest first, in one round trip. Not a Lua script: a script that
        returns frames makes Redis copy each one into the script and again into the reply (about
        4x the server CPU of LMOVE for a 225 KB frame)."""
        if limit <= 0:
            return []
        move = ("LMOVE", self.frames_key, self.processing_key, "RIGHT", "LEFT")
        return [frame for frame in self.reader.bulks(*[move] * limit) if frame is not None]

    def ack(self, count: int, uploads: Sequence[str] = ()) -> None:
        """Drop the `count` oldest frames in hand, the batch just answered, and `uploads` (ACK_FRAMES_LUA)."""
        if count > 0:
            self._ack(keys=[self.processing_key, *uploads], args=[count])

    def give_back(self, frames: Sequence[memoryview]) -> None:
        """The oldest frames in hand (these, in order) back to the front of the list, in one step."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(self.frames_key, *reversed(frames))
        pipe.ltrim(self.processing_key, 0, -(len(frames) + 1))
        pipe.execute()

    def forget(self) -> None:
        """Nothing to forget: what is in hand is in the processing list alone."""


# Giving a worker's unanswered frames back, on the control plane and wherever its lists lie (the control plane itself,
# or each bulk shard: contract.shards), in three steps: the fence, the move, the count.
# The fence, on the control plane: KEYS[1] the worker's heartbeat ('' when it gives back its own), KEYS[2] its
# epoch. -1 if it lives; else 1, its epoch deleted (a paused worker finds it gone and writes nothing more).
_FENCE = """
if KEYS[1] ~= '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
  redis.call('DEL', KEYS[2])
end
return 1
"""

# The move, where the lists lie: the worker's processing lists back to their frame lists, oldest first in line; the
# job ids read from the moved frames' headers. KEYS per model its processing list and its frame list. Two reapers
# cannot both move a frame: the second finds the processing list empty.
_MOVE_BACK = (
    FRAME_JOB_ID_LUA
    + """
local moved = {}
for k = 1, #KEYS, 2 do
  while true do
    local frame = redis.call('LMOVE', KEYS[k], KEYS[k + 1], 'LEFT', 'RIGHT')
    if not frame then break end
    moved[#moved + 1] = frame_job_id(frame) or ''
  end
end
return moved
"""
)

# The count, on the control plane: an attempt more on each job (KEYS) that still exists (a step towards `poison`).
_COUNT_ATTEMPTS = """
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then redis.call('HINCRBY', key, 'attempts', 1) end
end
return #KEYS
"""


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
    if int(client.register_script(_FENCE)(keys=[heartbeat, keys.gpu_epoch(worker_id)])) == -1:
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
        client.register_script(_COUNT_ATTEMPTS)(keys=counted)
    if only_if_dead and complete:
        client.zrem(keys.gpu_workers, worker_id)
    return len(moved)


def move_back(server: redis.Redis, keys: Keys, worker_id: str, model_keys: Sequence[str]) -> list[str]:
    """This worker's processing lists on one server back to their frame lists (no attempt counted): the job ids of
    the frames moved ('' for a frame without one)."""
    lists = [key for model_key in model_keys for key in (keys.processing(worker_id, model_key), keys.frames(model_key))]
    return [raw.decode() for raw in server.register_script(_MOVE_BACK)(keys=lists)]
