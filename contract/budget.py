"""What may wait in Redis: a model's jobs (its backlog) and the bytes of uploads and frames, per model and in
all (`backpressure.max_waiting_bytes`, `max_total_waiting_bytes`).

A count of jobs does not bound memory: at 20 MiB an upload, 256 waiting jobs are 5 GB. So the API reserves
an upload's bytes before it stores it, in the step that checks the budgets (`admit`: concurrent uploads
cannot all get in under the limit), and every step that drops bytes from Redis gives them back in the same
atomic step: the CPU worker's push (the upload goes, the frame comes), whatever ends a job (its upload goes)
and the GPU worker's batch write (its frames go). The counters live in one hash, `Keys.waiting_bytes`:
a field per model (name:version). The total (`*` where it is reported) is their sum, read where it is checked
(admission): one counter moved per step, not two (issue 58; a `*` field an earlier version wrote is left out
of the sum). They never go below zero (frames and uploads from a version without budgets are given back as if
they had been counted).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis

from contract.keys import Keys

ALL = "*"

# Lua functions other scripts call to give bytes back: HINCRBY, never below zero. release_waiting gives one model's
# bytes back; release_each gives back {model: bytes} (a step that ended many jobs): one HINCRBY a model, not one a
# job, with what one release after another would leave (each stops at zero, and a sum of decrements stops there too).
RELEASE_LUA = """
local function release_field(waiting, field, bytes)
  if bytes > 0 and field ~= '' and redis.call('HINCRBY', waiting, field, -bytes) < 0 then
    redis.call('HSET', waiting, field, 0)
  end
end

local function release_waiting(waiting, model, bytes)
  release_field(waiting, model or '', tonumber(bytes) or 0)
end

local function release_each(waiting, by_model)
  for model, bytes in pairs(by_model) do release_field(waiting, model, bytes) end
end
"""

# A Lua function: admit(k, last, a). KEYS[k] the model's frame list, KEYS[k + 1] the frames-waiting hash (with
# bulk shards, the frames on them: contract.shards; '' without), KEYS[k + 2] the waiting-bytes hash, KEYS[k + 3]
# the tenant's own CPU queue, KEYS[k + 4..last] the model's other CPU queues; ARGV[a] the model,
# ARGV[a + 1] the bytes to reserve, ARGV[a + 2] its backlog limit (jobs), ARGV[a + 3] its byte budget,
# ARGV[a + 4] the total's, ARGV[a + 5] how many jobs the tenant may have waiting in its own queue. Returns
# {verdict, backlog, model bytes, all bytes} (after the reservation when admitted). ADMISSION_ARGS is its count
# of arguments: another script (the result cache's lookup, contract.jobs.intake) calls it on its own offsets, with
# admission_arguments()'s keys and arguments.
ADMIT_LUA = f"""
local function admit(k, last, a)
  local own = redis.call('LLEN', KEYS[k + 3])
  local sharded = 0   -- without bulk shards the key is '': no frames wait there, no HGET an image to say so
  if KEYS[k + 1] ~= '' then sharded = math.max(0, tonumber(redis.call('HGET', KEYS[k + 1], ARGV[a]) or '0')) end
  local backlog = redis.call('LLEN', KEYS[k]) + sharded + own
  for i = k + 4, last do backlog = backlog + redis.call('LLEN', KEYS[i]) end
  local waiting = redis.call('HGETALL', KEYS[k + 2])   -- a field a model: the total is their sum
  local model_bytes, all_bytes = 0, 0
  for i = 1, #waiting, 2 do
    if waiting[i] ~= '{ALL}' then
      local bytes = math.max(0, tonumber(waiting[i + 1]) or 0)
      all_bytes = all_bytes + bytes
      if waiting[i] == ARGV[a] then model_bytes = bytes end
    end
  end
  local size = tonumber(ARGV[a + 1])
  if own >= tonumber(ARGV[a + 5]) then return {{'tenant_backlog', own, model_bytes, all_bytes}} end
  if backlog >= tonumber(ARGV[a + 2]) then return {{'backlog', backlog, model_bytes, all_bytes}} end
  if model_bytes + size > tonumber(ARGV[a + 3]) then return {{'model_bytes', backlog, model_bytes, all_bytes}} end
  if all_bytes + size > tonumber(ARGV[a + 4]) then return {{'all_bytes', backlog, model_bytes, all_bytes}} end
  if size > 0 then redis.call('HINCRBY', KEYS[k + 2], ARGV[a], size) end
  return {{'admitted', backlog, model_bytes + size, all_bytes + size}}
end
"""
ADMISSION_ARGS = 6
_ADMIT = ADMIT_LUA + "return admit(1, #KEYS, 1)\n"
_RELEASE = RELEASE_LUA + "release_waiting(KEYS[1], ARGV[1], ARGV[2])\n"

ADMITTED, OVER_BACKLOG, OVER_MODEL_BYTES, OVER_ALL_BYTES = "admitted", "backlog", "model_bytes", "all_bytes"
OVER_TENANT_BACKLOG = "tenant_backlog"


class BudgetVerdict(NamedTuple):
    """ADMIT_LUA's answer: whether the budgets took a new job, and the figures a refusal is explained with."""

    verdict: str  # ADMITTED, or which limit refused it
    backlog: int  # the model's jobs waiting (its CPU queues and its frame list); the tenant's own
    # (its CPU queue) when that refused it
    model_bytes: int  # bytes the model has waiting in Redis
    all_bytes: int  # bytes every model has waiting

    @classmethod
    def of(cls, reply: Any) -> BudgetVerdict:
        """ADMIT_LUA's reply."""
        return cls(reply[0].decode(), int(reply[1]), int(reply[2]), int(reply[3]))


class AdmissionRequest(NamedTuple):
    """What a new job asks of the budgets: a model's `size` bytes for `tenant` within these limits."""

    model_key: str
    size: int
    max_backlog: int
    max_model_bytes: int
    max_all_bytes: int
    tenant: str = ""
    tenants: Sequence[str] = ("",)
    max_tenant_backlog: int | None = None
    sharded: bool = True  # frames may wait on bulk shards (their count is read); False: none can


def admission_arguments(keys: Keys, request: AdmissionRequest) -> tuple[list[str], list[Any]]:
    """The keys and arguments ADMIT_LUA's admit() reads for `request` (its keys: five or more)."""
    own = keys.celery_queue(keys.preprocess_queue(request.model_key, request.tenant))
    others = [keys.celery_queue(queue) for queue in keys.preprocess_queues(request.model_key, request.tenants)]
    names = [
        keys.frames(request.model_key),
        keys.frames_waiting if request.sharded else "",
        keys.waiting_bytes,
        own,
        *[queue for queue in others if queue != own],
    ]
    tenant_backlog = request.max_backlog if request.max_tenant_backlog is None else request.max_tenant_backlog
    return names, [
        request.model_key,
        request.size,
        request.max_backlog,
        request.max_model_bytes,
        request.max_all_bytes,
        tenant_backlog,
    ]


class WaitingBytes:
    """The budgets' counters in one Redis."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._unreleased: list[tuple[str, int]] = []  # given back while Redis was away: again at each flush
        self._lock = threading.Lock()

    def admit(
        self,
        model_key: str,
        size: int,
        max_backlog: int,
        max_model_bytes: int,
        max_all_bytes: int,
        tenant: str = "",
        tenants: Sequence[str] = ("",),
        max_tenant_backlog: int | None = None,
        sharded: bool = True,
    ) -> BudgetVerdict:
        """Reserve `size` bytes for a model's new job of `tenant`'s if its backlog, the tenant's share of it and
        both budgets allow it, in one step."""
        keys, args = admission_arguments(
            self.keys,
            AdmissionRequest(
                model_key,
                size,
                max_backlog,
                max_model_bytes,
                max_all_bytes,
                tenant,
                tenants,
                max_tenant_backlog,
                sharded,
            ),
        )
        return BudgetVerdict.of(self._admit(keys=keys, args=args))

    def release(self, model_key: str, size: int, client: Any = None) -> None:
        """Give back bytes reserved for a job that was not stored after all (in a pipeline: with it)."""
        if size > 0:
            self._release(keys=[self.keys.waiting_bytes], args=[model_key, size], client=client or self.redis)

    def release_later(self, model_key: str, size: int) -> None:
        """Bytes that could not be given back (Redis away: a restart, a failover): kept here and given back at
        the next `flush_unreleased`. Dropped, they would stay counted as waiting for good."""
        if size > 0:
            with self._lock:
                self._unreleased.append((model_key, size))

    def flush_unreleased(self) -> int:
        """Give back what `release_later` kept; what Redis still refuses stays for the next flush. How many
        were given back."""
        with self._lock:
            pending, self._unreleased = self._unreleased, []
        done = 0
        for index, (model_key, size) in enumerate(pending):
            try:
                self.release(model_key, size)
            except redis.RedisError:
                with self._lock:
                    self._unreleased[:0] = pending[index:]
                break
            done += 1
        return done

    def waiting(self) -> dict[str, int]:
        """Bytes waiting, per model and `*` for all (their sum)."""
        raw: Any = self.redis.hgetall(self.keys.waiting_bytes)
        return with_total({name.decode(): int(value) for name, value in raw.items()})


def with_total(counters: dict[str, int]) -> dict[str, int]:
    """The waiting-bytes hash's fields (each at least zero) and `*`, their sum (a stored `*` left out: an earlier
    release counted the total in a field of its own)."""
    models = {name: max(0, value) for name, value in counters.items() if name != ALL}
    return {**models, ALL: sum(models.values())}
