"""What may wait in Redis: a model's jobs (its backlog) and the bytes of uploads and frames, per model and in
all (`backpressure.max_waiting_bytes`, `max_total_waiting_bytes`).

A count of jobs does not bound memory: at 20 MiB an upload, 256 waiting jobs are 5 GB. So the API reserves
an upload's bytes before it stores it, in the step that checks the budgets (`admit`: concurrent uploads
cannot all get in under the limit), and every step that drops bytes from Redis gives them back in the same
atomic step: the CPU worker's push (the upload goes, the frame comes), whatever ends a job (its upload goes)
and the GPU worker's batch write (its frames go). The counters live in one hash, `Keys.waiting_bytes`:
a field per model (name:version) and `*` for all. They never go below zero (frames and uploads from a
version without budgets are given back as if they had been counted).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import redis

from contract.keys import Keys

ALL = "*"

# A Lua function other scripts call to give bytes back: HINCRBY, never below zero.
RELEASE_LUA = f"""
local function release_waiting(waiting, model, bytes)
  bytes = tonumber(bytes) or 0
  if bytes <= 0 then return end
  for _, field in ipairs({{model or '', '{ALL}'}}) do
    if field ~= '' and redis.call('HINCRBY', waiting, field, -bytes) < 0 then
      redis.call('HSET', waiting, field, 0)
    end
  end
end
"""

# KEYS[1] the model's frame list, KEYS[2] the waiting-bytes hash, KEYS[3] the tenant's own CPU queue, KEYS[4..]
# the model's other CPU queues; ARGV[1] the model, ARGV[2] the bytes to reserve, ARGV[3] its backlog limit
# (jobs), ARGV[4] its byte budget, ARGV[5] the total's, ARGV[6] how many jobs the tenant may have waiting in
# its own queue. Returns {verdict, backlog, model bytes, all bytes} (after the reservation when admitted).
_ADMIT = f"""
local own = redis.call('LLEN', KEYS[3])
local backlog = redis.call('LLEN', KEYS[1]) + own
for i = 4, #KEYS do backlog = backlog + redis.call('LLEN', KEYS[i]) end
local model_bytes = math.max(0, tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0'))
local all_bytes = math.max(0, tonumber(redis.call('HGET', KEYS[2], '{ALL}') or '0'))
local size = tonumber(ARGV[2])
if own >= tonumber(ARGV[6]) then return {{'tenant_backlog', own, model_bytes, all_bytes}} end
if backlog >= tonumber(ARGV[3]) then return {{'backlog', backlog, model_bytes, all_bytes}} end
if model_bytes + size > tonumber(ARGV[4]) then return {{'model_bytes', backlog, model_bytes, all_bytes}} end
if all_bytes + size > tonumber(ARGV[5]) then return {{'all_bytes', backlog, model_bytes, all_bytes}} end
if size > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], size)
  redis.call('HINCRBY', KEYS[2], '{ALL}', size)
end
return {{'admitted', backlog, model_bytes + size, all_bytes + size}}
"""
_RELEASE = RELEASE_LUA + "release_waiting(KEYS[1], ARGV[1], ARGV[2])\n"

ADMITTED, OVER_BACKLOG, OVER_MODEL_BYTES, OVER_ALL_BYTES = "admitted", "backlog", "model_bytes", "all_bytes"
OVER_TENANT_BACKLOG = "tenant_backlog"


class Admission(NamedTuple):
    verdict: str          # ADMITTED, or which limit refused it
    backlog: int          # the model's jobs waiting (its CPU queues and its frame list); the tenant's own
                          # (its CPU queue) when that refused it
    model_bytes: int      # bytes the model has waiting in Redis
    all_bytes: int        # bytes every model has waiting


class WaitingBytes:
    """The budgets' counters in one Redis."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)

    def admit(self, model_key: str, size: int, max_backlog: int, max_model_bytes: int, max_all_bytes: int,
              tenant: str = "", tenants: Sequence[str] = ("",), max_tenant_backlog: int | None = None) -> Admission:
        """Reserve `size` bytes for a model's new job of `tenant`'s if its backlog, the tenant's share of it and
        both budgets allow it, in one step."""
        own = self.keys.celery_queue(self.keys.preprocess_queue(model_key, tenant))
        others = [self.keys.celery_queue(queue) for queue in self.keys.preprocess_queues(model_key, tenants)]
        reply: Any = self._admit(keys=[self.keys.frames(model_key), self.keys.waiting_bytes, own,
                                       *[queue for queue in others if queue != own]],
                                 args=[model_key, size, max_backlog, max_model_bytes, max_all_bytes,
                                       max_backlog if max_tenant_backlog is None else max_tenant_backlog])
        return Admission(reply[0].decode(), int(reply[1]), int(reply[2]), int(reply[3]))

    def release(self, model_key: str, size: int, client: Any = None) -> None:
        """Give back bytes reserved for a job that was not stored after all (in a pipeline: with it)."""
        if size > 0:
            self._release(keys=[self.keys.waiting_bytes], args=[model_key, size], client=client or self.redis)

    def waiting(self) -> dict[str, int]:
        """Bytes waiting, per model and `*` for all."""
        raw: Any = self.redis.hgetall(self.keys.waiting_bytes)
        return {name.decode(): max(0, int(value)) for name, value in raw.items()}
