"""A GPU worker's heartbeat: what it says about itself every third of its TTL.

Written by the GPU worker (`gpu_worker/heartbeat.py`) under `Keys.heartbeat(id)`
and read by the API (`/readyz`, `/v1/models`, `/v1/stats`) and by a starting
worker that finds its id taken. JSON, validated on both sides: a heartbeat
that does not parse is no heartbeat (the API skips it; a starting worker
treats it as a previous life's).
"""

from __future__ import annotations

from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract.redis.clock import now as service_now
from contract.redis.keys import Keys


class HeartbeatModel(BaseModel):
    """The model as this worker serves it: the spec's public description plus where it runs."""

    model_config = ConfigDict(extra="allow")  # labels, layout, precision, ... pass through to /v1/models

    name: str
    version: str
    device: str
    simulated: bool = False
    stats: dict[str, Any] = Field(default_factory=dict, description="this model's recent jobs: p95_ms, jobs")

    @property
    def key(self) -> str:
        return f"{self.name}:{self.version}"


class Batching(BaseModel):
    max_batch_size: int
    window_ms: float


class Heartbeat(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a newer worker may say more than this reader knows

    worker_id: str
    pid: int
    host: str
    started_at: float = Field(description="epoch seconds")
    model: HeartbeatModel  # the first model it serves (what readers before `models` read)
    models: list[HeartbeatModel] = Field(default_factory=list, description="every model it serves")
    batching: Batching | None = None
    stats: dict[str, Any] = Field(default_factory=dict, description="busy fraction, totals, recent time bill")

    def served_models(self) -> list[HeartbeatModel]:
        return self.models or [self.model]

    def to_redis(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_redis(cls, raw: bytes | str | None) -> Heartbeat | None:
        if raw is None:
            return None
        try:
            return cls.model_validate_json(raw)
        except ValidationError:
            return None


def live_heartbeats(client: redis.Redis, keys: Keys, ttl_s: float) -> list[Heartbeat]:
    """Self-descriptions of the GPU workers whose heartbeat has not expired."""
    worker_ids: Any = client.zrangebyscore(keys.gpu_workers, service_now() - ttl_s, "+inf")
    if not worker_ids:
        return []
    beats: Any = client.mget([keys.heartbeat(w.decode()) for w in worker_ids])
    return [beat for beat in map(Heartbeat.from_redis, beats) if beat is not None]
