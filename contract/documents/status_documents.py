"""The public JSON documents about the service itself: liveness and readiness, the models it serves, its stats.

As contract.documents' (whose `Document` base they share): the answers are built through them and the OpenAPI
document is generated from them; built from GPU workers' heartbeats, they ignore fields they do not name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from contract.documents import Document


class Health(Document):
    status: Literal["ok"]


class Home(Document):
    """`GET /`: where to go from here."""

    name: Literal["imgserve"]
    version: str
    links: dict[str, str] = Field(
        description="the docs page, the OpenAPI document, submitting, the models, health, readiness, stats, "
        "and Flower when the deployment says where it is (`api.flower_url`)"
    )
    try_it: str = Field(description="a first request, as a shell command")


class Readiness(Document):
    ready: bool
    redis: bool = Field(description="the job store answers")
    gpu_workers: int = Field(ge=0, description="GPU workers with a fresh heartbeat")
    detail: str


class ModelDefaults(Document):
    conf: float
    iou: float
    max_det: int


class QueueDepths(Document):
    preprocess: int = Field(ge=0, description="jobs waiting for a CPU worker")
    frames: int = Field(ge=0, description="frames waiting for a GPU worker")


class ServedModel(Document):
    name: str
    version: str
    weights: str | None
    labels: list[str]
    input_size: int
    layout: str
    format: str
    simulated: bool | None = Field(None, description="served by the `sim` device; absent while no worker serves it")
    precision: str | None = Field(None, description="what the model computes in: fp32, fp16 or bf16")
    output: str | None = Field(None, description="tensor, or element 0 of a tuple (YOLOv5's own export)")
    from_file: list[str] | None = Field(
        None, description="spec settings read from the model file (its config.txt): labels, input_size"
    )
    defaults: ModelDefaults
    state: Literal["serving", "draining"] = Field(
        description="draining: takes no new jobs; remove it once its queue is empty"
    )
    default: bool = Field(description="a request without `model` may get this version")
    share: float = Field(ge=0, le=1, description="its share of `model=<name>` requests (0: reached only pinned)")
    devices: list[str]
    workers: list[str] = Field(description="live GPU workers serving it")
    # Every tenant's traffic: with API keys, shown to an admin key only (as /v1/stats), null to any other.
    queue: QueueDepths | None = Field(description="jobs waiting, every tenant's; null but to an admin key")
    p95_ms: float | None = Field(
        description="request start to result, p95 over the serving workers' recent "
        "window (the slowest worker's); null without recent jobs, and but to an admin key"
    )
    recent_jobs: int | None = Field(ge=0, description="jobs answered in that window; null but to an admin key")


class ModelName(Document):
    name: str
    versions: list[str]
    routes: dict[str, float] = Field(description="`model=<name>`: version -> weight (empty: every version draining)")


class ModelList(Document):
    models: list[ServedModel]
    names: list[ModelName]


class StageSummary(Document):
    p50: float
    p95: float
    mean: float
    share: float = Field(description="fraction of the mean total")


StageSummaries = dict[str, StageSummary]


class HostStageTime(Document):
    wall: float = Field(description="ms per batch, wall clock")
    cpu: float = Field(description="ms per batch, the stage thread's CPU time")


class GpuWorkerStats(Document):
    worker_id: str
    device: str
    simulated: bool
    busy: float = Field(None, description="fraction of the recent window the device computed")
    busy_window_s: float = None
    nvml_utilisation: float | None = None
    device_seconds_total: float = None
    batches_total: int = None
    frames_total: int = None
    updated_at: float = None
    window_s: float = None
    batches: int = Field(None, description="batches in the recent window")
    batch_size_mean: float | None = None
    batch_size_histogram: dict[str, int] = None
    time_bill_ms: StageSummaries = None
    host_ms_per_batch: dict[str, HostStageTime] = Field(
        None,
        description="the worker's host time per batch by stage since it started (its collect, stage, "
        "device and finish threads): wall, and the stage thread's CPU",
    )


class GpuSummary(Document):
    workers: int
    simulated: bool = None
    busy: float = Field(None, description="mean busy fraction across workers")
    device_seconds_total: float = None
    frames_total: int = None
    batches_total: int = None
    batch_size_mean: float | None = None
    time_bill_ms: StageSummaries = Field(None, description="the busiest worker's recent time bill, per stage")


class ModelStats(Document):
    worker_id: str = Field(
        description="the worker whose window this is (of those serving the model, the one "
        "that answered most of its recent jobs)"
    )
    jobs: int = Field(ge=0, description="jobs answered in the window")
    p95_ms: float | None = None
    batches: int = None
    batch_size_mean: float | None = None
    time_bill_ms: StageSummaries = None


class CacheModelStats(Document):
    hits: int = Field(ge=0)
    misses: int = Field(ge=0)
    hit_rate: float = Field(ge=0.0, le=1.0, description="hits / (hits + misses), since the counters began")


class CacheStats(Document):
    enabled: bool
    shared: bool = Field(description="one cache for every API key (true) or one per key (false)")
    entries: int = Field(ge=0, description="the entries; with `redis`, its keys that carry a TTL (its INFO)")
    bytes: int = Field(
        ge=0,
        description="charged against max_bytes: the documents plus a fixed overhead each; with `redis`, its "
        "used_memory (entries, counters, Redis's overhead), read at most once a second",
    )
    max_bytes: int = Field(ge=0)
    maxmemory: int | None = Field(
        None, description="with `redis`: its maxmemory, the cache's size there (0: none); null: the control plane's"
    )
    ttl_s: int = Field(ge=1)
    models: dict[str, CacheModelStats] = Field(description="per name:version")
    redis: str | None = Field(
        None, description="the cache's own Redis (cache.redis_url) without a password; null: the control plane's"
    )
    available: bool = Field(
        True, description="false: the cache's own Redis did not answer (counts read as 0; lookups miss)"
    )


class ScalingSignal(Document):
    """One model's backlog as the product sees it, and the CPU worker processes it wants (contract.workers.scaling)."""

    backlog: int = Field(ge=0, description="jobs accepted and not yet taken by a GPU worker: queued + held + frames")
    queued: int = Field(ge=0, description="on the model's CPU queues, taken by no worker")
    held: int = Field(ge=0, description="held by a CPU worker: prefetched, or decoding")
    frames: int = Field(ge=0, description="frames waiting for a GPU worker")
    rate_per_s: float = Field(ge=0, description="jobs answered a second over the GPU workers' recent windows")
    cpu_ms: float = Field(ge=0, description="the CPU stage an image (decode + resize, the windows' mean)")
    cpu_ms_measured: bool = Field(description="false: scaling.default_cpu_ms, no job answered in the windows")
    target_utilisation: float
    drain_s: float = Field(description="what waits for a CPU worker is to be decoded within this long")
    cpu_workers_wanted: int = Field(
        ge=0,
        description="ceil((rate_per_s x cpu_ms + (queued + held) x cpu_ms / drain_s) / target_utilisation), "
        "cpu_ms in seconds: the CPU worker processes (pool children) that keep up; 0 with no backlog",
    )
    cpu_processes_wanted: float | None = Field(
        None, ge=0, description="the same before rounding up: several models' wants add up as these (an autoscaler's)"
    )


class CellStats(Document):
    name: str
    redis: str = Field(description="its control plane's Redis, without a password")
    status: Literal["up", "unavailable"] = Field(description="unavailable: its Redis did not answer this read")
    backlog: int | None = Field(description="jobs waiting for a CPU or GPU worker, every model")
    rate: float | None = Field(description="jobs a second its GPU workers answered lately (null until measured)")
    jobs: dict[str, int] | None = Field(description="live jobs: queued (CPU), queued_gpu, and every live one")


class CellTotals(Document):
    cells: int
    up: int
    backlog: int
    rate: float | None
    jobs: dict[str, int]


class CellsStats(Document):
    cells: list[CellStats] = Field(description="each cell (docs/cells.md); one without `cells` configured")
    totals: CellTotals = Field(description="over the cells that answered")


class Stats(Document):
    scaling: dict[str, ScalingSignal] = Field(
        None, description="per name:version: its backlog and the CPU worker processes it wants (an autoscaler's signal)"
    )
    cache: CacheStats = Field(description="the result cache")
    queues: QueueDepths = Field(description="summed over the models")
    queues_by_model: dict[str, QueueDepths] = Field(description="per name:version")
    gpu_workers: list[GpuWorkerStats]
    gpu: GpuSummary
    models: dict[str, ModelStats] = Field(description="per name:version: its recent jobs, p95, batches and time bill")
    cells: CellsStats | None = Field(None, description="each cell's Redis, state, backlog, rate and live jobs")
