"""An expensive upload's decode charged to its API key before its job is queued (contract.admission.decode_share): a key
whose charged decodes in flight would pass `auth.max_decode_bytes_in_flight` with it is refused, 429, so one
key's 16-bit or interlaced at-cap PNGs hold one CPU child at a time, never the whole pool."""

from __future__ import annotations

import redis

from app.problems import Problem
from contract.admission.decode_share import CHARGED_FROM, MIB, DecodeShare, decode_cost, retry_after_s
from contract.redis.clock import now as service_now
from contract.settings import Settings


def charge(share: DecodeShare, settings: Settings, client_id: str, job_id: str, data: bytes, deadline_at: float) -> int:
    """The bytes of decoding charged to `client_id` for `job_id` (0: none, a cheap image or no keys), or a 429."""
    limit = settings.auth.max_decode_bytes_in_flight
    cost = decode_cost(data) if client_id and limit > 0 else 0
    if cost < CHARGED_FROM:
        return 0
    lapse_at = deadline_at + settings.celery.task_time_limit_s
    taken, held = share.take(client_id, job_id, cost, limit, service_now(), lapse_at)
    if not taken:
        raise Problem(
            429,
            "overloaded",
            "Too many requests",
            f"your images being decoded already cost {held / MIB:.0f} MiB of decoding and this one "
            f"{cost / MIB:.0f} MiB (16-bit and interlaced images count for more); your share in flight is "
            f"{limit / MIB:.0f} MiB, so retry once they are done",
            headers={"Retry-After": str(retry_after_s(held))},
        )
    return cost


def release(share: DecodeShare, job_id: str, charged: int) -> None:
    """A job that was not queued after all: its charge, if `charged`, goes now (else it lapses by itself)."""
    if not charged:
        return
    try:
        share.release(job_id)
    except redis.RedisError:  # Redis away: the charge lapses after the job's deadline
        pass
