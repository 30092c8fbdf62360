"""What /v1/stats reads of each cell (app.stats): its live GPU workers, its backlogs, its live jobs and the rate its
GPU workers answer; and the `cells` part of the answer. With several cells, a cell whose Redis does not answer is
`unavailable` there, never an error; with one, its Redis's error is the answer's (a 503), as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import redis

from app.cells import CellServices, cell_unreachable
from contract.jobs.record import QUEUED, QUEUED_GPU
from contract.jobs.timebill import host_ms_per_batch
from contract.redis.keys import model_frames_total
from contract.workers.heartbeat import Heartbeat, live_heartbeats
from contract.workers.scaling import ModelBacklog, backlogs


@dataclass
class CellReading:
    """One cell as /v1/stats read it; `up` False: its Redis did not answer (nothing else is filled in)."""

    cell: CellServices
    up: bool = True
    workers: list[Heartbeat] = field(default_factory=list)
    backlogs: dict[str, ModelBacklog] = field(default_factory=dict)
    live: int = 0  # jobs not ended yet (the deadline index holds each until it ends)
    rate: float | None = None  # jobs a second its GPU workers answered lately, every model together

    def to_json(self) -> dict[str, Any]:
        summary: dict[str, Any] = {"name": self.cell.name, "redis": self.cell.address}
        if not self.up:
            return {**summary, "status": "unavailable", "backlog": None, "rate": None, "jobs": None}
        waiting = {
            QUEUED: sum(b.queued + b.held for b in self.backlogs.values()),
            QUEUED_GPU: sum(b.frames for b in self.backlogs.values()),
        }
        return {
            **summary,
            "status": "up",
            "backlog": sum(b.total for b in self.backlogs.values()),
            "rate": None if self.rate is None else round(self.rate, 3),
            "jobs": {**waiting, "live": self.live},
        }


def read_cell(cell: CellServices, model_keys: list[str], several: bool) -> CellReading:
    """`cell` read for /v1/stats; with `several` cells, one that does not answer is read as unavailable."""
    try:
        return _read(cell, model_keys)
    except redis.RedisError as exc:
        if several and cell_unreachable(exc):
            return CellReading(cell, up=False)
        raise


def _read(cell: CellServices, model_keys: list[str]) -> CellReading:
    client, keys = cell.redis, cell.keys
    workers = live_heartbeats(client, keys, cell.settings.gpu_worker.heartbeat_ttl_s)
    for worker in workers:  # live totals, fresher than the heartbeat's
        raw = cast(dict[bytes, bytes], client.hgetall(keys.gpu_counters(worker.worker_id)))
        # The worker's totals come with its heartbeat; its per-model frames (contract.redis.keys.model_frames_total)
        # come with each batch's write: their sum is its frames answered up to now, where the beat's lags by up to one.
        per_model = model_frames_total("")
        counters = {k.decode(): float(v) for k, v in raw.items() if not k.decode().startswith(per_model)}
        frames = sum(float(v) for k, v in raw.items() if k.decode().startswith(per_model))
        counters["frames_total"] = max(counters.get("frames_total", 0.0), frames)
        worker.stats.update(counters, host_ms_per_batch=host_ms_per_batch(counters))
    found = backlogs(client, keys, model_keys, cell.settings.tenants)
    live = int(cast(int, client.zcard(keys.deadlines)))
    rates = [cell.loads.drains.drain(key).rate for key in model_keys]
    measured = [rate for rate in rates if rate is not None]
    return CellReading(cell, True, workers, found, live, sum(measured) if measured else None)


def cells_document(readings: list[CellReading]) -> dict[str, Any]:
    """/v1/stats' `cells`: each cell, and the totals over those that answered."""
    up = [reading for reading in readings if reading.up]
    each = [reading.to_json() for reading in readings]
    rates = [reading.rate for reading in up if reading.rate is not None]
    jobs: dict[str, int] = {}
    for summary in each:
        for state, count in (summary["jobs"] or {}).items():
            jobs[state] = jobs.get(state, 0) + count
    return {
        "cells": each,
        "totals": {
            "cells": len(readings),
            "up": len(up),
            "backlog": sum(summary["backlog"] or 0 for summary in each),
            "rate": round(sum(rates), 3) if rates else None,
            "jobs": jobs,
        },
    }


def merged_backlogs(readings: list[CellReading], model_keys: list[str]) -> dict[str, ModelBacklog]:
    """Per model, its backlog over every cell that answered."""
    return {
        key: ModelBacklog(
            sum(r.backlogs[key].queued for r in readings if r.up),
            sum(r.backlogs[key].held for r in readings if r.up),
            sum(r.backlogs[key].frames for r in readings if r.up),
        )
        for key in model_keys
    }
