"""The GPU list in Redis, seen from one GPU worker.

Frames move, never vanish: BLMOVE/LMOVE carry each frame from the shared list
into this worker's processing list, and only `ack` removes them once their
results are written. A worker that dies leaves its frames there to be found.
"""
from __future__ import annotations

from typing import Any

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

    def ack(self, count: int, client: Any = None) -> None:
        """Drop the `count` oldest frames of the processing list (the batch just answered)."""
        (client or self.redis).ltrim(self.processing_key, 0, -(count + 1))

    def pending(self) -> int:
        return int(self.redis.llen(self.processing_key))
