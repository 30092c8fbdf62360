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

from contract.library import Step
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys

# A slot lapses this long after its attempt's deadline: the attempt's own Redis writes come after its POST.
LAPSE_MARGIN_S = 10.0

# The library's steps (contract/library/callback_slots.lua, where their keys and arguments are named).
_TAKE, _GIVE_BACK = Step("take_callback_slot"), Step("give_back_callback_slot")
_FREE_LAPSED = Step("free_lapsed_callback_slots")


class TenantSlots:
    """Take a slot of a tenant's before an attempt, give it back after (see the module's note)."""

    def __init__(self, client: redis.Redis, keys: Keys, cap: int, hold_s: float) -> None:
        """`hold_s`: how long an attempt may take (its deadline); a slot lapses LAPSE_MARGIN_S after it."""
        self.client, self.keys, self.cap, self.hold_s = client, keys, cap, hold_s

    def take(self, tenant: str, job_id: str) -> str | None:
        """A slot's token, or None: the job id waits in the tenant's held list until a slot is given back."""
        token, now = uuid.uuid4().hex, service_now()
        taken = _TAKE(
            self.client,
            [self.keys.callback_slots(tenant), self.keys.callback_held(tenant), self.keys.callback_held_tenants],
            [now, token, now + self.hold_s + LAPSE_MARGIN_S, self.cap, job_id, tenant],
        )
        return token if taken else None

    def give_back(self, tenant: str, token: str) -> None:
        _GIVE_BACK(
            self.client,
            [
                self.keys.callback_slots(tenant),
                self.keys.callback_held(tenant),
                self.keys.callback_held_tenants,
                self.keys.callback_outbox,
            ],
            [token, tenant],
        )

    def free_lapsed(self) -> int:
        """The relays' sweep: held callbacks of tenants whose slots lapsed (or were freed with none held then)
        moved to the outbox. How many moved."""
        return int(
            _FREE_LAPSED(
                self.client,
                [self.keys.callback_held_tenants, self.keys.callback_outbox],
                [self.keys.callback_slots(""), self.keys.callback_held(""), service_now(), self.cap],
            )
        )
