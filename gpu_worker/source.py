"""The GPU list in Redis, seen from one GPU worker.

Frames move, never vanish: BLMOVE/LMOVE carry each frame from the shared list
into this worker's processing list, and only `ack` removes them once their
results are written. A worker that dies leaves its frames there to be found.
"""
from __future__ import annotations

from typing import Any, Sequence

import redis

from contract.keys import Keys

# Move up to ARGV[1] frames, oldest first, in one round trip.
_MOVE_UP_TO = """
local moved = {}
for i = 1, tonumber(ARGV[1]) do
  local frame = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
  if not frame then break end
  moved[#moved + 1] = frame
end
return moved
"""


# Give a worker's unanswered frames back to the shared list, oldest first in line, and count
# one more attempt on each job. KEYS[1] processing list, KEYS[2] frame list, KEYS[3] the
# worker's heartbeat (if it lives, nothing is touched), KEYS[4] the worker registry;
# ARGV[1] job key prefix, ARGV[2] worker id. Atomic, so two reapers never both requeue.
_REQUEUE = """
if KEYS[3] ~= '' and redis.call('EXISTS', KEYS[3]) == 1 then
  return -1
end
local moved = 0
while true do
  local frame = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not frame then break end
  moved = moved + 1
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
if KEYS[3] ~= '' then
  redis.call('ZREM', KEYS[4], ARGV[2])
end
return moved
"""


def requeue_frames_of(client: redis.Redis, keys: Keys, worker_id: str, only_if_dead: bool) -> int:
    """Move `worker_id`'s processing list back to the frame list; -1 if it turned out alive."""
    script = client.register_script(_REQUEUE)
    heartbeat = keys.heartbeat(worker_id) if only_if_dead else ""
    return int(script(keys=[keys.processing(worker_id), keys.frames, heartbeat, keys.gpu_workers],
                      args=[keys.job(""), worker_id]))


class RedisFrameSource:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str) -> None:
        self.redis = client
        self.frames_key = keys.frames
        self.processing_key = keys.processing(worker_id)
        self._move_up_to = client.register_script(_MOVE_UP_TO)

    def pop_blocking(self, timeout_s: float) -> bytes | None:
        # Oldest frame is at the right (producers LPUSH): FIFO.
        return self.redis.blmove(self.frames_key, self.processing_key, timeout_s, "RIGHT", "LEFT")

    def pop_available(self, limit: int) -> list[bytes]:
        if limit <= 0:
            return []
        return list(self._move_up_to(keys=[self.frames_key, self.processing_key], args=[limit]))

    def ack(self, frames: Sequence[bytes], client: Any = None) -> None:
        """Drop answered frames from the processing list, by value: whatever else is in hand stays."""
        pipe = client if client is not None else self.redis.pipeline(transaction=True)
        for frame in frames:
            pipe.lrem(self.processing_key, 1, frame)
        if client is None:
            pipe.execute()

    def give_back(self, frames: Sequence[bytes]) -> None:
        """Return frames taken but not answered to the front of the shared list."""
        pipe = self.redis.pipeline(transaction=True)
        for frame in reversed(frames):   # the oldest ends rightmost: popped first
            pipe.lrem(self.processing_key, 1, frame)
            pipe.rpush(self.frames_key, frame)
        pipe.execute()

    def pending(self) -> int:
        return int(self.redis.llen(self.processing_key))
