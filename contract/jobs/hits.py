"""What a key's answers hold in the store: a result-cache hit's job, stored ended at once, charged to its API key and
holding a reference to its answer; a computed job's answer, charged to its key by the batch write that stores it.

Every accepted request is charged somewhere. A miss passes the budgets (contract.admission.budget) and waits its turn; a
hit adds nothing to wait, but its job record stays readable for `jobs.ttl_s` (longer while its callback is
retried, up to `jobs.max_ttl_s` from its submission). So:

- A hit's record holds no copy of the answer: `result_ref` names the digest, and a read resolves the answer
  from `Keys.hit_result(digest)` (JobStore.load). That shared answer is copied from the cache entry at the
  digest's first hit, one copy however many hits, and every hit pushes its lifetime out to `jobs.max_ttl_s`
  (the longest any record may live): no hit's record can outlive it, so a 202'd hit stays readable whatever
  the cache evicts meanwhile. It is charged to the hit that makes it.
- Each API key's answers take their bytes from one token bucket of `jobs.answer_bytes_per_key` bytes, refilled at
  that many bytes per `jobs.ttl_s`: a hit the record's fields and HIT_RECORD_OVERHEAD (and the shared answer's, by
  the hit that makes it), before it is stored; a computed job what the GPU worker's batch write stores for it (its
  answer, time bill and batch: `stored_bytes`), after, once per key per batch (`answer_debits`). A computed answer
  is never lost for a short bucket: the bucket goes into debt, and while it is there the key's submissions are
  refused by the admission (take_in reads the key's debt marker, Keys.answer_debt) with a 429 and the time until
  the refill has paid it. What may live longer than `jobs.ttl_s` (the shared answer, a record whose callback may keep
  it) is charged for each `jobs.ttl_s` it may live. So a key's hits hold at most about twice the bucket in the
  store at any moment: an empty bucket is a 429 with the time until it holds the hit's bytes again.
- The lookup that found the entry and this step are two round trips (contract.jobs.intake): an entry evicted
  or expired in between answers HIT_GONE, and the API looks up again (a miss then: admitted as any).

The bucket runs on the service's clock, passed in (contract.redis.clock), as every Lua step of the service does, and
refills as the service's other buckets do (contract.admission.token_bucket's `refilled`: its mark never moves back).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from contract.redis.keys import Keys
from contract.settings import Settings

# What a hit's record costs Redis beyond its fields' bytes (its key, the hash's and the TTL's own, the allocator's
# rounding), so that a key's bucket is charged about what its hits hold (docs/benchmarks/2026-12-07-comment-figures.md).
HIT_RECORD_OVERHEAD = 400
RESULT_REF = "result_ref"  # the record's field naming the digest of its shared answer (Keys.hit_result)
HIT_GONE = "gone"  # the entry went between the lookup and the hit's step: look up again

# The hit's job is the library's `store_hit` (contract/library/hits.lua, where its keys and arguments are named;
# JobIntake builds them).


class HitLimited(NamedTuple):
    """A hit refused: its key's answers used their bytes; the bucket holds this hit's again in `retry_after_ms`. Or
    any submission of a key whose bucket is in debt (its computed answers overdrew it): out of it in that long."""

    retry_after_ms: int


@dataclass(frozen=True)
class HitLimits:
    """What bounds one key's hits, from the settings: the bucket's bytes (0: no bound) and its refill, and how
    long a record may live (the shared answers' TTL) against how long it lives without a callback."""

    bucket_bytes: int = 0
    ttl_s: int = 3600
    max_ttl_s: int = 3600

    @classmethod
    def of(cls, settings: Settings) -> HitLimits:
        return cls(settings.jobs.answer_bytes_per_key, settings.jobs.ttl_s, settings.jobs.max_ttl_s)

    @property
    def refill_per_s(self) -> float:
        return self.bucket_bytes / max(1, self.ttl_s)

    @property
    def answer_ttl_s(self) -> int:
        """The shared answer's lifetime from a hit: past any record's that refers to it."""
        return max(self.ttl_s, self.max_ttl_s)

    @property
    def answer_lifetimes(self) -> int:
        """How many `ttl_s` a shared answer (or a record a callback keeps) may live: what it is charged for."""
        return math.ceil(self.answer_ttl_s / max(1, self.ttl_s))

    def charge(self, record_bytes: int, has_callback: bool) -> int:
        """A hit's bytes for its record: a record a callback may keep past `ttl_s` pays for each `ttl_s` it may
        live."""
        return (record_bytes + HIT_RECORD_OVERHEAD) * (self.answer_lifetimes if has_callback else 1)


def stored_bytes(flat: Sequence[Any]) -> int:
    """What the field names and values a job's end stores take (finish_arguments' flat list for one job)."""
    return sum(len(item) if isinstance(item, bytes | str) else len(str(item)) for item in flat)


def answer_debits(limits: HitLimits, keys: Keys, spent: Mapping[str, int], now: float) -> list[Any]:
    """write_batch's answer-debit arguments (debit_answers, contract/library/token_bucket.lua): the bucket's bytes,
    its refill a second and `now`, then each API key's bucket and what its answers of the batch stored (`spent`);
    nothing when there is no bound or no key's answer."""
    owned = [(owner, spent[owner]) for owner in spent if owner and spent[owner] > 0]
    if limits.bucket_bytes <= 0 or not owned:
        return []
    debits: list[Any] = [limits.bucket_bytes, repr(limits.refill_per_s), repr(now)]
    for owner, size in owned:
        debits += [keys.hit_bucket(owner), size]
    return debits
