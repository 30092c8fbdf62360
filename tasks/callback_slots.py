"""How many callback attempts one tenant may have in flight: its slots, in Redis, shared by every callback worker.

A receiver that never answers holds a callback thread for an attempt's whole deadline; sixteen of one tenant's
callbacks to one held all sixteen threads of a worker, and every other tenant's callbacks waited. Each attempt now
takes one of its tenant's `callbacks.max_per_tenant` slots first. Without one free, the job id waits in the
tenant's held list, in Redis, holding no thread; the attempt that gives a slot back moves the first held one to
the outbox. A slot is a token scored by when it lapses (its attempt's deadline and a margin): a worker that died
holding one frees it then, and the relays, looking at the tenants with held callbacks each second, move those
on. The tenant is the job's API key; without keys, the callback URL's host (one slow receiver then holds no more
than its share, whoever sent the jobs).
"""

from __future__ import annotations

import uuid

import redis

from contract.clock import now as service_now
from contract.keys import Keys

# A slot lapses this long after its attempt's deadline: the attempt's own Redis writes come after its POST.
LAPSE_MARGIN_S = 10.0

# KEYS[1] the tenant's slots, KEYS[2] its held list, KEYS[3] the held tenants; ARGV[1] now, ARGV[2] a token,
# ARGV[3] when it lapses, ARGV[4] the cap, ARGV[5] the job id, ARGV[6] the tenant. 1: a slot taken; 0: held.
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('ZADD', KEYS[1], tonumber(ARGV[3]), ARGV[2])
  redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(ARGV[3])) + 1)
  return 1
end
redis.call('RPUSH', KEYS[2], ARGV[5])
redis.call('SADD', KEYS[3], ARGV[6])
return 0
"""

# KEYS[1] the tenant's slots, KEYS[2] its held list, KEYS[3] the held tenants, KEYS[4] the outbox; ARGV[1] the
# token, ARGV[2] the tenant. The slot given back, and the first callback held for one handed on.
_GIVE_BACK = """
redis.call('ZREM', KEYS[1], ARGV[1])
local job_id = redis.call('LPOP', KEYS[2])
if job_id then
  redis.call('RPUSH', KEYS[4], job_id)
  redis.call('PUBLISH', KEYS[4], job_id)
end
if redis.call('LLEN', KEYS[2]) == 0 then redis.call('SREM', KEYS[3], ARGV[2]) end
return job_id
"""

# KEYS[1] the held tenants, KEYS[2] the outbox; ARGV[1] the slots' key prefix, ARGV[2] the held lists' prefix,
# ARGV[3] now, ARGV[4] the cap. For each tenant with callbacks held: its lapsed slots dropped, and as many held
# ones moved to the outbox as it has slots free. Returns how many moved.
_FREE_LAPSED = """
local moved = 0
for _, tenant in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local slots, held = ARGV[1] .. tenant, ARGV[2] .. tenant
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', ARGV[3])
  local free = tonumber(ARGV[4]) - redis.call('ZCARD', slots)
  while free > 0 do
    local job_id = redis.call('LPOP', held)
    if not job_id then break end
    redis.call('RPUSH', KEYS[2], job_id)
    free = free - 1
    moved = moved + 1
  end
  if redis.call('LLEN', held) == 0 then redis.call('SREM', KEYS[1], tenant) end
end
if moved > 0 then redis.call('PUBLISH', KEYS[2], 'held') end
return moved
"""


class TenantSlots:
    """Take a slot of a tenant's before an attempt, give it back after (see the module's note)."""

    def __init__(self, client: redis.Redis, keys: Keys, cap: int, hold_s: float) -> None:
        """`hold_s`: how long an attempt may take (its deadline); a slot lapses LAPSE_MARGIN_S after it."""
        self.client, self.keys, self.cap, self.hold_s = client, keys, cap, hold_s
        self._take = client.register_script(_TAKE)
        self._give_back = client.register_script(_GIVE_BACK)
        self._free_lapsed = client.register_script(_FREE_LAPSED)

    def take(self, tenant: str, job_id: str) -> str | None:
        """A slot's token, or None: the job id waits in the tenant's held list until a slot is given back."""
        token, now = uuid.uuid4().hex, service_now()
        taken = self._take(
            keys=[self.keys.callback_slots(tenant), self.keys.callback_held(tenant), self.keys.callback_held_tenants],
            args=[now, token, now + self.hold_s + LAPSE_MARGIN_S, self.cap, job_id, tenant],
        )
        return token if taken else None

    def give_back(self, tenant: str, token: str) -> None:
        self._give_back(
            keys=[
                self.keys.callback_slots(tenant),
                self.keys.callback_held(tenant),
                self.keys.callback_held_tenants,
                self.keys.callback_outbox,
            ],
            args=[token, tenant],
        )

    def free_lapsed(self) -> int:
        """The relays' sweep: held callbacks of tenants whose slots lapsed (or were freed with none held then)
        moved to the outbox. How many moved."""
        return int(
            self._free_lapsed(
                keys=[self.keys.callback_held_tenants, self.keys.callback_outbox],
                args=[self.keys.callback_slots(""), self.keys.callback_held(""), service_now(), self.cap],
            )
        )
