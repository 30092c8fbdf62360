"""Which cell a new job goes to (docs/cells.md): the power of two choices over the cells that are up, by each
cell's backlog of the model over the rate its GPU workers answer it, two cells drawn in proportion to their
`gpu_capacity`.

Each cell's figures are the ones its Redis already keeps (contract.jobs.backlog's queue depths; the GPU workers'
answered-frame counters, read as a rate by app.drain), read at most once a second per cell and model in this
process: the choice itself costs no round trip. Why not a hash of the job id (blind to load and health: a cell
whose GPUs died keeps its share) or of the image (a hot image piles onto one cell): docs/cells.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from app.admission_readings import LOOK_S, ReadAtMostEvery
from app.drain import DrainMeter
from contract.jobs.backlog import add_depth_reads, depths_from
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys, model_frames_total
from contract.workers.heartbeat import Heartbeat


@dataclass(frozen=True)
class Load:
    """A model's load in one cell: jobs waiting for it, the jobs a second its GPU workers answer lately (None
    until measured), and whether any live GPU worker serves it."""

    backlog: int = 0
    rate: float | None = None
    unserved: bool = False

    def wait_s(self) -> float | None:
        """Seconds the backlog takes to drain at the rate: 0 with nothing waiting, infinite when no GPU worker
        serves the model or nothing drained while work waited; None while the rate is not known yet."""
        if self.unserved:
            return math.inf
        if self.backlog <= 0:
            return 0.0
        if self.rate is None:
            return None
        return self.backlog / self.rate if self.rate > 0 else math.inf


class CellLoads:
    """One cell's loads, per model, each read from its Redis at most once per LOOK_S."""

    def __init__(self, client: redis.Redis, keys: Keys, tenants: Sequence[str], heartbeat_ttl_s: float) -> None:
        self.redis, self.keys, self.tenants, self.ttl_s = client, keys, tenants, heartbeat_ttl_s
        self.drains = DrainMeter(client, keys, heartbeat_ttl_s)  # its own readings: admission's are its refusals'
        self._loads: dict[str, ReadAtMostEvery[Load]] = {}

    def load(self, model_key: str) -> Load:
        """The model's load as last read (a fresh reading once a second); a Redis error when it does not answer."""
        reading = self._loads.get(model_key)
        if reading is None:
            reading = self._loads.setdefault(model_key, ReadAtMostEvery(LOOK_S, lambda: self._read(model_key), Load()))
        return reading.get()

    def _read(self, model_key: str) -> Load:
        """The model's backlog and the live GPU workers in one round trip, and those workers' heartbeats and
        counters in a second only when there are any: queue_depths and DrainMeter.drain apart took two to four,
        each cell a second in every API process."""
        pipe = self.redis.pipeline(transaction=False)
        add_depth_reads(pipe, self.keys, [model_key], self.tenants)
        pipe.zrangebyscore(self.keys.gpu_workers, service_now() - self.ttl_s, "+inf")
        replies = iter(pipe.execute())
        depths = depths_from(replies, [model_key], self.tenants)[model_key]
        workers = [w.decode() if isinstance(w, bytes) else str(w) for w in next(replies)]
        drain = self.drains.record(model_key, self._totals(model_key, workers))
        return Load(sum(depths.values()), drain.rate, drain.unserved)

    def _totals(self, model_key: str, workers: list[str]) -> dict[str, float] | None:
        """DrainMeter.read_totals' figures for the live `workers`: each one serving the model, its frames of it
        answered so far; None when none serves it."""
        if not workers:
            return None
        pipe = self.redis.pipeline(transaction=False)
        pipe.mget([self.keys.heartbeat(worker) for worker in workers])
        for worker in workers:
            pipe.hget(self.keys.gpu_counters(worker), model_frames_total(model_key))
        beats, *counts = pipe.execute()
        serving = {
            worker: float(count or 0)
            for worker, raw, count in zip(workers, beats, counts, strict=True)
            if (beat := Heartbeat.from_redis(raw)) is not None
            and any(model.key == model_key for model in beat.served_models())
        }
        return serving or None


def less_loaded(first: tuple[Load, float], second: tuple[Load, float]) -> bool:
    """Whether the first of two (load, gpu_capacity) is to be preferred (a tie keeps the first drawn): by the
    seconds each backlog takes to drain where both rates are known, else by backlog per unit of capacity."""
    (load_a, capacity_a), (load_b, capacity_b) = first, second
    wait_a, wait_b = load_a.wait_s(), load_b.wait_s()
    if wait_a is not None and wait_b is not None:
        return wait_a <= wait_b
    if wait_a == math.inf or wait_b == math.inf:  # the one known never to drain loses
        return wait_b == math.inf
    return load_a.backlog / capacity_a <= load_b.backlog / capacity_b


def two_drawn(weights: Sequence[float], draw: Callable[[], float] = random.random) -> tuple[int, int]:
    """Two distinct places drawn in proportion to `weights` (at least two of them)."""
    first = _draw(weights, draw)
    rest = [0.0 if index == first else weight for index, weight in enumerate(weights)]
    return first, _draw(rest, draw)


def _draw(weights: Sequence[float], draw: Callable[[], float]) -> int:
    point = draw() * sum(weights)
    for index, weight in enumerate(weights):
        if weight > 0 and point < weight:
            return index
        point -= weight
    return max(index for index, weight in enumerate(weights) if weight > 0)
