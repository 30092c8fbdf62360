"""What may wait in Redis: a model's jobs (its backlog) and the bytes of uploads and frames, per model and in
all (`backpressure.max_waiting_bytes`, `max_total_waiting_bytes`).

A count of jobs does not bound memory: at 20 MiB an upload, 256 waiting jobs are 5 GB. So the API reserves
an upload's bytes before it stores it, in the step that checks the budgets (`admit`: concurrent uploads
cannot all get in under the limit), and every step that drops bytes from Redis gives them back in the same
atomic step: the CPU worker's push (the upload goes, the frame comes), whatever ends a job (its upload goes)
and the GPU worker's batch write (its frames go). The counters live in one hash, `Keys.waiting_bytes`:
a field per model (name:version). The total (`*` where it is reported) is their sum, read where it is checked
(admission): one counter moved per step, not two (a `*` field an earlier version wrote is left out of the
sum). They never go below zero (frames and uploads from a version without budgets are given back as if
they had been counted).

With API keys, a key's uploads are counted again under the key (`Keys.key_waiting_bytes`: a hash a key, a field per
model), and one key may hold at most `auth.max_waiting_bytes_share` of what the others leave of a model's budget and
of the total (the share x (budget - what the rest of it holds) / budget, the rest being the other keys' uploads and
the frames; alone and with no frames waiting, the share of the whole): past it that key alone is refused, so one
key's padded uploads cannot fill the budget every key shares, nor can several keys' together: n flooding keys leave
about budget/(n + 1) to the next. The job-count share (`auth.max_backlog_share` of the backlog) is of what the others
leave the same way. As the
job-count share counts a key's own CPU queue and not the frame list, a key's bytes are its uploads waiting for a CPU
worker: the steps that move an upload's bytes move the key's in the same atomic step (the reservation, the push
that trades the upload for a frame, whatever ends the job, a refused submission's give-back); a frame's bytes are
the model's alone (the frame list's bound caps them). A key with nothing waiting is always admitted by its share,
so an upload larger than the share still gets in, one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis

from contract.library import Step
from contract.redis.keys import Keys

ALL = "*"

# Bytes are given back by the library (contract/library/budget.lua: HINCRBY, never below zero).
# The steps `admit` and `release_bytes` (contract/library/admission.lua, where their keys and arguments are
# named; admission_arguments builds them). ADMISSION_ARGS is admit()'s count of arguments: the result cache's
# lookup (contract.jobs.intake) calls it too, on its own offsets.
_ADMIT, _RELEASE = Step("admit"), Step("release_bytes")
ADMISSION_ARGS = 8

ADMITTED, OVER_BACKLOG, OVER_MODEL_BYTES, OVER_ALL_BYTES = "admitted", "backlog", "model_bytes", "all_bytes"
OVER_TENANT_BACKLOG = "tenant_backlog"
OVER_KEY_MODEL_BYTES, OVER_KEY_ALL_BYTES = "key_model_bytes", "key_all_bytes"  # the key's share of either budget


class BudgetVerdict(NamedTuple):
    """the library's admit answer: whether the budgets took a new job, and the figures a refusal is explained with."""

    verdict: str  # ADMITTED, or which limit refused it
    backlog: int  # the model's jobs waiting (its CPU queues and its frame list); the tenant's own
    # (its CPU queue) when that refused it
    model_bytes: int  # bytes the model has waiting in Redis
    all_bytes: int  # bytes every model has waiting
    key_bytes: int = 0  # the API key's uploads waiting for the model; for all models when that share refused it
    share: int = 0  # the key's share that refused it, of what the others leave at this moment; 0: no share did

    @classmethod
    def of(cls, reply: Any) -> BudgetVerdict:
        """the library's admit reply."""
        share = int(reply[5]) if len(reply) > 5 else 0
        return cls(reply[0].decode(), int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4]), share)


class AdmissionRequest(NamedTuple):
    """What a new job asks of the budgets: a model's `size` bytes for `tenant` within these limits, and within
    `owner`'s (its API key's; "" for none) share of each byte budget."""

    model_key: str
    size: int
    max_backlog: int
    max_model_bytes: int
    max_all_bytes: int
    tenant: str = ""
    tenants: Sequence[str] = ("",)
    max_tenant_backlog: int | None = None
    sharded: bool = True  # frames may wait on bulk shards (their count is read); False: none can
    owner: str = ""
    max_owner_model_bytes: int = 0
    max_owner_all_bytes: int = 0


def admission_arguments(keys: Keys, request: AdmissionRequest) -> tuple[list[str], list[Any]]:
    """The keys and arguments the library's admit admit() reads for `request` (its keys: six or more)."""
    own = keys.celery_queue(keys.preprocess_queue(request.model_key, request.tenant))
    others = [keys.celery_queue(queue) for queue in keys.preprocess_queues(request.model_key, request.tenants)]
    names = [
        keys.frames(request.model_key),
        keys.frames_waiting if request.sharded else "",
        keys.waiting_bytes,
        own,
        keys.key_waiting_bytes(request.owner) if request.owner else "",
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
        request.max_owner_model_bytes,
        request.max_owner_all_bytes,
    ]


class WaitingBytes:
    """The budgets' counters in one Redis."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._unreleased: list[tuple[str, int, str]] = []  # given back while Redis was away: again at each flush
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
        owner: str = "",
        max_owner_model_bytes: int = 0,
        max_owner_all_bytes: int = 0,
    ) -> BudgetVerdict:
        """Reserve `size` bytes for a model's new job of `tenant`'s if its backlog, the tenant's share of it, both
        budgets and `owner`'s share of each allow it, in one step."""
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
                owner,
                max_owner_model_bytes,
                max_owner_all_bytes,
            ),
        )
        return BudgetVerdict.of(_ADMIT(self.redis, keys, args))

    def release(self, model_key: str, size: int, client: Any = None, owner: str = "") -> None:
        """Give back bytes reserved for a job that was not stored after all, and `owner`'s (the API key they
        were reserved for; in a pipeline: with it)."""
        if size > 0:
            _RELEASE(client or self.redis, [self.keys.waiting_bytes], [model_key, size, owner])

    def release_later(self, model_key: str, size: int, owner: str = "") -> None:
        """Bytes that could not be given back (Redis away: a restart, a failover): kept here and given back at
        the next `flush_unreleased`. Dropped, they would stay counted as waiting for good."""
        if size > 0:
            with self._lock:
                self._unreleased.append((model_key, size, owner))

    def flush_unreleased(self) -> int:
        """Give back what `release_later` kept; what Redis still refuses stays for the next flush. How many
        were given back."""
        with self._lock:
            pending, self._unreleased = self._unreleased, []
        done = 0
        for index, (model_key, size, owner) in enumerate(pending):
            try:
                self.release(model_key, size, owner=owner)
            except redis.RedisError:
                with self._lock:
                    self._unreleased[:0] = pending[index:]
                break
            done += 1
        return done

    def waiting(self, owner: str = "") -> dict[str, int]:
        """Bytes waiting, per model and `*` for all (their sum); `owner`'s alone when given (an API key's)."""
        raw: Any = self.redis.hgetall(self.keys.key_waiting_bytes(owner) if owner else self.keys.waiting_bytes)
        return with_total({name.decode(): int(value) for name, value in raw.items()})


def with_total(counters: dict[str, int]) -> dict[str, int]:
    """The waiting-bytes hash's fields (each at least zero) and `*`, their sum (a stored `*` left out: an earlier
    release counted the total in a field of its own)."""
    models = {name: max(0, value) for name, value in counters.items() if name != ALL}
    return {**models, ALL: sum(models.values())}
