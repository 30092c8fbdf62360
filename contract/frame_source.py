"""The frame list, out: a GPU worker's pops, its ack, give back and requeue (contract.frames is the frame itself).

Frames move, never vanish: BLMOVE/LMOVE carry each frame from the model's list into the worker's processing list,
and only its ack (`ACK_FRAMES_LUA`, the one place a frame is acked) removes them once their results are written; a
worker that dies leaves its frames there, and `requeue_frames_of` gives them back. The processing list is in the
order the frames were taken: the newest at the left, the oldest at the right. The worker answers its batches in
the order it took them, so a batch's frames are always the rightmost ones when it is acked, and the ack drops them
by count, without sending them back over the wire. After an error that may have left the worker unsure what it
holds (a Redis call that failed half way), it answers what it has in hand, then gives back whatever is left in
the list (`requeue_frames_of`): the order holds again.

With bulk shards (contract.shards) the same moves are contract.frame_shard_source's: a list per shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import redis

from contract.frames import FRAME_JOB_ID_LUA
from contract.keys import Keys
from contract.replies import PayloadReader

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


# Give a worker's unanswered frames back to their models' lists, oldest first in line, and (when
# ARGV[3] is 1: its worker died holding them) count one more attempt on each job. KEYS[1] the worker's
# heartbeat (if it lives, nothing is touched; '' when the worker gives back its own), KEYS[2] the worker
# registry, KEYS[3] the worker's epoch (deleted when reaping: a worker that was only paused finds it gone and
# writes nothing), then per model its processing list and its frame list; ARGV[1] job key prefix, ARGV[2]
# worker id. Atomic, so two reapers never both requeue.
_REQUEUE = (
    FRAME_JOB_ID_LUA
    + """
if KEYS[1] ~= '' and redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
if KEYS[1] ~= '' then
  redis.call('DEL', KEYS[3])
end
local function count_attempt(frame)
  local job_id = frame_job_id(frame)
  if job_id then
    local job = ARGV[1] .. job_id
    if redis.call('EXISTS', job) == 1 then
      redis.call('HINCRBY', job, 'attempts', 1)
    end
  end
end
local moved = 0
for k = 4, #KEYS, 2 do
  while true do
    local frame = redis.call('LMOVE', KEYS[k], KEYS[k + 1], 'LEFT', 'RIGHT')
    if not frame then break end
    moved = moved + 1
    if ARGV[3] == '1' then
      count_attempt(frame)
    end
  end
end
if KEYS[1] ~= '' then
  redis.call('ZREM', KEYS[2], ARGV[2])
end
return moved
"""
)


def requeue_frames_of(
    client: redis.Redis,
    keys: Keys,
    worker_id: str,
    model_keys: Sequence[str],
    only_if_dead: bool,
    count_attempt: bool = True,
) -> int:
    """Move `worker_id`'s processing lists of these models back to the models' frame lists; -1 if it
    turned out alive. `count_attempt`: the worker died holding them (a step towards `poison`)."""
    script = client.register_script(_REQUEUE)
    heartbeat = keys.heartbeat(worker_id) if only_if_dead else ""
    lists = [key for model_key in model_keys for key in (keys.processing(worker_id, model_key), keys.frames(model_key))]
    return int(
        script(
            keys=[heartbeat, keys.gpu_workers, keys.gpu_epoch(worker_id), *lists],
            args=[keys.job(""), worker_id, "1" if count_attempt else "0"],
        )
    )
