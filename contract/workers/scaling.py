"""The backlog as the product sees it, per model, and how many CPU worker processes it wants.

A model's backlog is every job accepted and not yet taken by a GPU worker:

- `queued`: its messages on the model's CPU queues (every tenant's list), which no worker has taken;
- `held`: its messages a CPU worker holds (tasks.hop.broker's holds: prefetched by the worker's main process, or its
  task running, the image decoding). A queue's length (what KEDA's Redis list scaler reads) misses these: a
  saturated pool with every message prefetched reads close to zero;
- `frames`: its frames waiting for a GPU worker (the frame list, and with bulk shards their lists' count).

`cpu_workers_wanted` is how many CPU worker processes (pool children: each decodes one image at a time) would keep
up with the model's rate and drain what waits within `scaling.drain_s`, each busy `scaling.target_utilisation` of
the time, so that `queue_cpu` stays near zero:

    wanted = ceil((rate x cpu_s + waiting_for_cpu x cpu_s / drain_s) / target_utilisation)

`rate` is the jobs a second the GPU workers answered for the model over their recent windows (summed over them),
`cpu_s` the CPU stage's mean (decode + resize) over those windows, or `scaling.default_cpu_ms` before any job was
answered, and `waiting_for_cpu` the backlog less its frames (a frame needs no CPU worker any more). A model with no
backlog at all wants none: its rate is an average over minutes that decays long after the last job, and would keep
a process alive for nothing. Several models add up their unrounded wants (`cpu_processes_wanted`) before rounding
once (`pool_wanted`): two models that each keep a tenth of a process busy want one process, not two. An autoscaler
clamps it to its own minimum and maximum (Celery's: tasks.hop.autoscale; KEDA: the ScaledObject's).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import redis

from contract.jobs.backlog import queue_depths
from contract.redis.clock import now as service_now
from contract.redis.keys import PREPROCESS_QUEUE, Keys
from contract.settings.scaling import ScalingSettings
from contract.workers.heartbeat import Heartbeat, live_heartbeats


@dataclass(frozen=True)
class ModelBacklog:
    queued: int  # on the model's CPU queues
    held: int  # in CPU workers' hands: prefetched, or decoding
    frames: int  # waiting for a GPU worker

    @property
    def total(self) -> int:
        return self.queued + self.held + self.frames

    @property
    def waiting_for_cpu(self) -> int:
        return self.queued + self.held


def model_of_queue(queue: str) -> str | None:
    """The model (name:version) of a CPU queue's name (Keys.preprocess_queue); None for any other queue."""
    if not queue.startswith(PREPROCESS_QUEUE + ":"):
        return None
    return queue.removeprefix(PREPROCESS_QUEUE + ":").partition("@")[0] or None


def held_by_model(client: redis.Redis, keys: Keys) -> Counter[str]:
    """Messages held by the registered CPU workers, per model: one HVALS and one LRANGE a worker (their hash and
    held list, a prefetch's worth each, not a backlog's)."""
    workers = cast(list[bytes], client.zrange(keys.cpu_workers, 0, -1))
    pipe = client.pipeline(transaction=False)
    for worker in workers:
        pipe.hvals(keys.celery_holds(worker.decode()))
        pipe.lrange(keys.celery_held(worker.decode()), 0, -1)
    held: Counter[str] = Counter()
    for values in pipe.execute() if workers else []:
        for value in values:
            try:
                entry = json.loads(value)  # the hash's [message, exchange, routing key, when]; the list's message
                routing_key = (
                    entry[2] if isinstance(entry, list) else entry["properties"]["delivery_info"]["routing_key"]
                )
            except (ValueError, IndexError, KeyError, TypeError):
                continue
            model = model_of_queue(str(routing_key))
            if model:
                held[model] += 1
    return held


def backlogs(
    client: redis.Redis, keys: Keys, model_keys: Sequence[str], tenants: Sequence[str] = ("",)
) -> dict[str, ModelBacklog]:
    """Per model (name:version): its jobs queued for a CPU worker (contract.jobs.backlog's depths), held by one,
    and its frames waiting."""
    depths = queue_depths(client, keys, model_keys, tenants)
    held = held_by_model(client, keys)
    return {key: ModelBacklog(depths[key]["preprocess"], held[key], depths[key]["frames"]) for key in model_keys}


@dataclass(frozen=True)
class Scaling:
    """One model's scaling signal, and what it was computed from."""

    backlog: int
    queued: int
    held: int
    frames: int
    rate_per_s: float  # jobs answered a second, over the GPU workers' recent windows
    cpu_ms: float  # the CPU stage's mean an image (decode + resize)
    cpu_ms_measured: bool  # False: scaling.default_cpu_ms (no job answered in the windows)
    target_utilisation: float
    drain_s: float
    cpu_workers_wanted: int
    cpu_processes_wanted: float = 0.0  # before rounding up: what several models' wants add up as

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def wanted_processes(backlog: ModelBacklog, rate_per_s: float, cpu_ms: float, settings: ScalingSettings) -> float:
    """CPU worker processes, unrounded, that keep up with `rate_per_s` and drain what waits for a CPU worker within
    settings.drain_s, each busy target_utilisation of the time; none with no backlog (see the module's note)."""
    if backlog.total == 0:
        return 0.0
    cpu_s = max(0.0, cpu_ms) / 1000.0
    busy = rate_per_s * cpu_s + backlog.waiting_for_cpu * cpu_s / settings.drain_s
    return round(busy / settings.target_utilisation, 6)


def wanted_workers(backlog: ModelBacklog, rate_per_s: float, cpu_ms: float, settings: ScalingSettings) -> int:
    """wanted_processes rounded up: one model's whole processes (its gauge, its share in /v1/stats)."""
    return math.ceil(wanted_processes(backlog, rate_per_s, cpu_ms, settings))


def pool_wanted(signals: Iterable[Scaling], nodes: int, minimum: int, maximum: int) -> int:
    """One autoscaling node's pool size for the models it takes: their unrounded wants summed, shared among `nodes`,
    rounded up once, within minimum..maximum (idle models: the minimum)."""
    total = sum(signal.cpu_processes_wanted for signal in signals)
    return max(minimum, min(maximum, math.ceil(round(total / max(1, nodes), 6))))


def scaling_signal(backlog: ModelBacklog, windows: Sequence[Mapping[str, Any]], settings: ScalingSettings) -> Scaling:
    """The signal for one model from its backlog and the GPU workers' recent windows for it (each: `jobs`,
    `window_s` and `time_bill_ms` with `decode` and `resize` means)."""
    jobs = sum(int(window.get("jobs") or 0) for window in windows)
    rate = sum((window.get("jobs") or 0) / window["window_s"] for window in windows if window.get("window_s"))
    weighted = [
        (int(window.get("jobs") or 0), _cpu_mean(window.get("time_bill_ms") or {}))
        for window in windows
        if window.get("jobs")
    ]
    measured = [(count, mean) for count, mean in weighted if mean is not None]
    if jobs and measured:
        cpu_ms = sum(count * cast(float, mean) for count, mean in measured) / sum(count for count, _ in measured)
    else:
        cpu_ms = settings.default_cpu_ms
    processes = wanted_processes(backlog, rate, cpu_ms, settings)
    return Scaling(
        backlog=backlog.total,
        queued=backlog.queued,
        held=backlog.held,
        frames=backlog.frames,
        rate_per_s=round(rate, 3),
        cpu_ms=round(cpu_ms, 3),
        cpu_ms_measured=bool(jobs and measured),
        target_utilisation=settings.target_utilisation,
        drain_s=settings.drain_s,
        cpu_workers_wanted=math.ceil(processes),  # wanted_workers
        cpu_processes_wanted=processes,
    )


def _cpu_mean(time_bill: Mapping[str, Any]) -> float | None:
    stages = [time_bill.get(stage) for stage in ("decode", "resize")]
    if not all(isinstance(stage, Mapping) and "mean" in stage for stage in stages):
        return None
    return float(sum(cast(Mapping[str, float], stage)["mean"] for stage in stages))


def gpu_windows(client: redis.Redis, keys: Keys, ttl_s: float) -> dict[str, list[dict[str, Any]]]:
    """Per model, the live GPU workers' recent windows for it: what scaling_signal reads."""
    return windows_of(live_heartbeats(client, keys, ttl_s), service_now())


def windows_of(beats: Sequence[Heartbeat], now: float) -> dict[str, list[dict[str, Any]]]:
    """Per model, these heartbeats' recent windows for it: jobs, time_bill_ms, and window_s no longer than the
    worker has run (a worker up for 10 s counted its jobs over 10 s, not its 60 s window)."""
    windows: dict[str, list[dict[str, Any]]] = {}
    for beat in beats:
        for model in beat.served_models():
            window = dict(model.stats)
            span = float(window.get("window_s") or beat.stats.get("window_s") or 0.0)
            window["window_s"] = max(0.0, min(span, now - beat.started_at))
            windows.setdefault(model.key, []).append(window)
    return windows
