"""The backlog: per model, the jobs waiting for a CPU worker and the frames waiting for a GPU worker.

Read by the API's admission (a refusal's Retry-After), its health and stats pages; the admission's own count
is in Lua (contract.admission.budget's admit), from the same lists.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis

from contract.redis.keys import Keys


def queue_depths(
    client: redis.Redis, keys: Keys, model_keys: Sequence[str], tenants: Sequence[str] = ("",)
) -> dict[str, dict[str, int]]:
    """Per model (name:version): jobs waiting for a CPU worker (its Celery lists, one per tenant: see
    Keys.preprocess_queue) and frames waiting for a GPU worker, in one round trip."""
    pipe = client.pipeline(transaction=False)
    add_depth_reads(pipe, keys, model_keys, tenants)
    return depths_from(iter(pipe.execute()), model_keys, tenants)


def add_depth_reads(pipe: Any, keys: Keys, model_keys: Sequence[str], tenants: Sequence[str] = ("",)) -> None:
    """queue_depths' reads, added to `pipe` (app.cell_choice sends them with its other reads: one round trip)."""
    for model_key in model_keys:
        for queue in keys.preprocess_queues(model_key, tenants):
            pipe.llen(keys.celery_queue(queue))
        pipe.llen(keys.frames(model_key))
        pipe.hget(keys.frames_waiting, model_key)  # with bulk shards: their lists' count (contract.redis.shards)


def depths_from(
    replies: Iterator[Any], model_keys: Sequence[str], tenants: Sequence[str] = ("",)
) -> dict[str, dict[str, int]]:
    """queue_depths from the replies of add_depth_reads' commands (taken from `replies`, in order)."""
    depths = {}
    for model_key in model_keys:
        preprocess = sum(int(next(replies)) for _ in tenants)
        frames = int(next(replies)) + max(0, int(next(replies) or 0))  # a drifted count is no negative backlog
        depths[model_key] = {"preprocess": preprocess, "frames": frames}
    return depths


def total_depths(depths: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """queue_depths summed over the models."""
    return {
        "preprocess": sum(d["preprocess"] for d in depths.values()),
        "frames": sum(d["frames"] for d in depths.values()),
    }
