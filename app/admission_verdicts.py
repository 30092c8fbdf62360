"""Admission's refusals: a budget's verdict (contract.admission.budget's admit) or an API key's decode share
(contract.admission.decode_share) as the problem that names the limit, with how long to wait. `Admission`
(app.admission) decides; this says no, and when to come back: the model's waiting work over the rate its GPU workers
answer it now (app.drain: measured while refusals come, not averaged over an idle past)."""

from __future__ import annotations

import math

import redis

from app.byte_shares import key_share_refusal
from app.drain import DrainMeter, retry_after_s
from app.problems import Problem
from contract.admission import budget
from contract.admission.decode_share import MIB
from contract.admission.decode_share import retry_after_s as decode_retry_after_s
from contract.jobs.backlog import queue_depths
from contract.redis.keys import Keys
from contract.settings import Settings
from contract.settings.models import ModelSpec


def retry_after_header(retry_after_ms: int) -> dict[str, str]:
    """A bucket's wait (ms) as a refusal's Retry-After: whole seconds, at least one."""
    return {"Retry-After": str(max(1, math.ceil(retry_after_ms / 1000)))}


def decode_share_refusal(held: int, cost: int, limit: int) -> Problem:
    """The 429 of a key whose charged decodes in flight (`held` bytes) would pass `auth.max_decode_bytes_in_flight`
    with this upload's `cost`: one key's 16-bit or interlaced at-cap PNGs hold one CPU child at a time, never the
    whole pool."""
    return Problem(
        429,
        "overloaded",
        "Too many requests",
        f"your images being decoded already cost {held / MIB:.0f} MiB of decoding and this one "
        f"{cost / MIB:.0f} MiB (16-bit and interlaced images count for more); your share in flight is "
        f"{limit / MIB:.0f} MiB, so retry once they are done",
        headers={"Retry-After": str(decode_retry_after_s(held))},
    )


class Verdicts:
    """The budgets' refusals for one cell's Redis: which limit, and the Retry-After its model's drain gives."""

    def __init__(self, settings: Settings, client: redis.Redis, keys: Keys) -> None:
        self.settings, self.redis, self.keys = settings, client, keys
        self.drains = DrainMeter(client, keys, settings.gpu_worker.heartbeat_ttl_s)  # read on refusals only

    def store_full(self, spec: ModelSpec) -> Problem:
        """The 503 while Redis is past `store_full_ratio` of its memory, whatever the budgets say."""
        return Problem(
            503,
            "store-full",
            "Service unavailable",
            "the job store is full; retry later",
            headers={"Retry-After": str(self.retry_after(spec, 1.0))},
        )

    def settle(self, spec: ModelSpec, request: budget.AdmissionRequest, verdict: budget.BudgetVerdict) -> None:
        """Nothing when `verdict` admitted the job; else the problem that says which limit refused it."""
        if verdict.verdict == budget.ADMITTED:
            return
        size = request.size
        share = verdict.share or request.max_tenant_backlog or request.max_backlog
        if verdict.verdict == budget.OVER_TENANT_BACKLOG:
            retry = self.retry_after(spec, (verdict.backlog - share + 1) / max(1, verdict.backlog))
            raise Problem(
                429,
                "overloaded",
                "Too many requests",
                f"{verdict.backlog} of your jobs are waiting for model {spec.key} (your share of what the "
                f"other keys leave of its backlog is {share}); retry later",
                headers={"Retry-After": str(retry)},
            )
        refusal = key_share_refusal(spec, request, verdict, self.retry_after)
        if refusal is not None:
            raise refusal
        if verdict.verdict == budget.OVER_BACKLOG:
            limit = self.settings.max_backlog(spec)
            retry = self.retry_after(spec, (verdict.backlog - limit + 1) / max(1, verdict.backlog))
            raise Problem(
                429,
                "overloaded",
                "Too many requests",
                f"{verdict.backlog} jobs are waiting for model {spec.key} (limit {limit}); retry later",
                headers={"Retry-After": str(retry)},
            )
        if verdict.verdict == budget.OVER_MODEL_BYTES:
            limit = self.settings.max_waiting_bytes(spec)
            retry = self.retry_after(spec, (verdict.model_bytes + size - limit) / max(1, verdict.model_bytes))
            raise Problem(
                429,
                "overloaded",
                "Too many requests",
                f"model {spec.key} has {verdict.model_bytes} bytes of images waiting (limit {limit}); retry later",
                headers={"Retry-After": str(retry)},
            )
        limit = self.settings.backpressure.max_total_waiting_bytes
        retry = self.retry_after(spec, (verdict.all_bytes + size - limit) / max(1, verdict.all_bytes))
        raise Problem(
            503,
            "store-full",
            "Service unavailable",
            f"{verdict.all_bytes} bytes of images are waiting (limit {limit}); retry later",
            headers={"Retry-After": str(retry)},
        )

    def retry_after(self, spec: ModelSpec, share: float) -> int:
        """Seconds until `share` of the model's waiting work has drained at the rate its GPU workers answer it now
        (app.drain), within [backpressure.retry_after_s, MAX_RETRY_AFTER_S]; the most when none serves it."""
        least = self.settings.backpressure.retry_after_s
        try:
            depths = queue_depths(self.redis, self.keys, [spec.key], self.settings.tenants)
            drain = self.drains.drain(spec.key)
        except redis.RedisError:
            return least
        return retry_after_s(max(share, 0.0) * sum(depths[spec.key].values()), drain, least)
