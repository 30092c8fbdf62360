"""The GPU list in Redis, seen from one GPU worker.

Frames move, never vanish: BLMOVE/LMOVE carry each frame from the shared list
into this worker's processing list, and only `ack` removes them once their
results are written. A worker that dies leaves its frames there to be found.

The processing list is in the order the frames were taken: the newest at the
left, the oldest at the right. The worker answers its batches in the order it
took them, so a batch's frames are always the rightmost ones when it is acked,
and `ack` drops them by count, without sending them back over the wire. After
an error that may have left the worker unsure what it holds (a Redis call that
failed half way), it answers what it has in hand, then gives back whatever is
left in the list (`requeue_frames_of`): the order holds again.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from contract.keys import Keys
from contract.replies import PayloadReader

# Give a worker's unanswered frames back to their models' lists, oldest first in line, and (when
# ARGV[3] is 1: its worker died holding them) count one more attempt on each job. KEYS[1] the worker's
# heartbeat (if it lives, nothing is touched; '' when the worker gives back its own), KEYS[2] the worker
# registry, KEYS[3] the worker's epoch (deleted when reaping: a worker that was only paused finds it gone and
# writes nothing), then per model its processing list and its frame list; ARGV[1] job key prefix, ARGV[2]
# worker id. Atomic, so two reapers never both requeue.
_REQUEUE = """
if KEYS[1] ~= '' and redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
if KEYS[1] ~= '' then
  redis.call('DEL', KEYS[3])
end
local function count_attempt(frame)
  local ok, header = pcall(function()
    local length = struct.unpack('>I4', string.sub(frame, 5, 8))
    return cjson.decode(string.sub(frame, 9, 8 + length))
  end)
  if ok and type(header) == 'table' and type(header.job_id) == 'string' then
    local job = ARGV[1] .. header.job_id
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


def requeue_frames_of(client: redis.Redis, keys: Keys, worker_id: str, model_keys: Sequence[str],
                      only_if_dead: bool, count_attempt: bool = True) -> int:
    """Move `worker_id`'s processing lists of these models back to the models' frame lists; -1 if it
    turned out alive. `count_attempt`: the worker died holding them (a step towards `poison`)."""
    script = client.register_script(_REQUEUE)
    heartbeat = keys.heartbeat(worker_id) if only_if_dead else ""
    lists = [key for model_key in model_keys for key in (keys.processing(worker_id, model_key), keys.frames(model_key))]
    return int(script(keys=[heartbeat, keys.gpu_workers, keys.gpu_epoch(worker_id), *lists],
                      args=[keys.job(""), worker_id, "1" if count_attempt else "0"]))


class RedisFrameSource:
    """One model's frame list, and this worker's processing list for it."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, model_key: str) -> None:
        self.redis = client
        self.frames_key = keys.frames(model_key)
        self.processing_key = keys.processing(worker_id, model_key)
        self.reader = PayloadReader(client)   # frames are read straight into one buffer each

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

    def ack(self, count: int, client: Any = None) -> None:
        """Drop the `count` oldest frames in hand: the batch just answered (see the module's note)."""
        if count > 0:
            (client if client is not None else self.redis).ltrim(self.processing_key, 0, -(count + 1))
