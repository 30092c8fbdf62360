"""The cells as one API process uses them (docs/cells.md): each cell's clients, job store, admission, result cache
and long-poll listener (`CellServices`, built by `build_cells`), and `Cells`: the cell a job id names, the cell a
new job goes to (app.cell_choice), and which cells this process found down lately.

A deployment without `cells` has one cell built from the top-level settings, exactly as the API always built its
parts: its choice is that cell, with no reading of any load, and its rate limits are that Redis's.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis

from app.admission import Admission
from app.cell_choice import CellLoads, Load, less_loaded, two_drawn
from app.listener_ticks import idle_closer, sweeper, ticks
from app.problems import Problem
from app.tier_buckets import TierBuckets
from app.waiters import JobEventListener
from contract.admission.token_bucket import TokenBuckets
from contract.cache import ResultCache
from contract.cache.cache_plane import cache_plane, redis_address
from contract.jobs.hits import HitLimits
from contract.jobs.ids import JobIds
from contract.jobs.intake import JobIntake
from contract.redis.clock import CLOCK
from contract.redis.connection import connect
from contract.redis.keys import Keys
from contract.redis.replication import AnswerNotReplicated, NotReplicated, Replication, durable_writes
from contract.redis.shards import ShardUnavailable, bulk_plane
from contract.settings import Settings
from contract.settings.cell_layout import Cell, cells_of
from contract.settings.models import Catalogue, UnknownModel

log = logging.getLogger("app.cells")

UPLOAD_CONNECTIONS = 8  # per API process: uploads written at once (more wait for one, up to the connect timeout)
# Per API process and cell: Redis round trips in flight at once, the pub/sub listener's connection included (more
# wait for one, up to the connect timeout): room for a burst over the steady load, and far more round trips a
# second than one process's core asks for.
REDIS_CONNECTIONS = 64


def cell_unreachable(exc: BaseException) -> bool:
    """Whether `exc` says a cell's control plane did not answer (a new job then goes to another cell); a bulk
    shard that did not answer is that shard's own failure (contract.redis.shards), answered as it always was."""
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and not isinstance(exc, ShardUnavailable)


def cell_budget_refusal(exc: BaseException) -> bool:
    """Whether `exc` is a 429 of one cell's own budgets (a model's backlog or bytes, a key's shares there): another
    cell's budgets may well have room. A key's rate (`rate-limited`) is the tier's, the same everywhere."""
    return isinstance(exc, Problem) and exc.status == 429 and exc.slug == "overloaded"


@dataclass
class CellServices:
    """One cell's parts in this API process."""

    index: int
    name: str
    gpu_capacity: float
    settings: Settings  # the top-level settings with this cell's redis_url, redis and bulk
    redis: redis.Redis
    keys: Keys
    store: JobIntake
    admission: Admission
    cache: ResultCache
    listener: JobEventListener
    address: str  # its Redis, without a password
    loads: CellLoads  # its load per model: the choice's (several cells) and /v1/stats' rate
    down_until: float = field(default=0.0)


class Cells:
    """The deployment's cells in this process: where a job lives, where a new one goes, which are down."""

    def __init__(
        self,
        cells: list[CellServices],
        job_ids: JobIds,
        catalogue: Catalogue,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cells, self.job_ids, self.catalogue = cells, job_ids, catalogue
        self.retry_s, self.clock = retry_s, clock

    def __iter__(self) -> Iterator[CellServices]:
        return iter(self.cells)

    def __len__(self) -> int:
        return len(self.cells)

    @property
    def first(self) -> CellServices:
        return self.cells[0]

    def at(self, index: int) -> CellServices | None:
        """The cell at `index` in `cells`, JobIds.check's place of the cell an id names (the first for ids made before
        cells); None for a cell this process has not."""
        return self.cells[index] if index < len(self.cells) else None

    def is_up(self, cell: CellServices) -> bool:
        return cell.down_until <= self.clock()

    def mark_down(self, cell: CellServices) -> None:
        """`cell` gets no new job from this process for `retry_s` (then it is tried again)."""
        if len(self.cells) > 1:
            log.warning("cell %s did not answer: no new jobs to it for %.1f s", cell.name, self.retry_s)
            cell.down_until = self.clock() + self.retry_s

    def choose(self, reference: str | None) -> CellServices:
        """The cell for a new job of the model `reference` names (app.admission routes it; None: the default):
        of two cells that are up drawn by capacity, the less loaded (app.cell_choice)."""
        if len(self.cells) == 1:
            return self.first
        chosen = self._choose(self._model_key(reference), besides=None)
        return chosen if chosen is not None else random.choice(self.cells)  # none up: any, it may be back

    def instead_of(self, cell: CellServices, exc: BaseException, reference: str | None) -> CellServices | None:
        """Where a submission goes when `cell` failed it with `exc`: None unless another cell is up and `exc` says
        the cell did not answer (it is then marked down), withdrew the job because its replicas did not take it
        in time (a failover in that cell: the job is not there, so it is made once, elsewhere), or refused it by
        its own budgets (cell_budget_refusal); a cell that answered stays up."""
        withdrawn = isinstance(exc, NotReplicated) and not isinstance(exc, AnswerNotReplicated)
        if len(self.cells) == 1 or not (cell_unreachable(exc) or withdrawn or cell_budget_refusal(exc)):
            return None
        if cell_unreachable(exc):
            self.mark_down(cell)
        return self._choose(self._model_key(reference), besides=cell)

    def _choose(self, model_key: str, besides: CellServices | None) -> CellServices | None:
        up = [cell for cell in self.cells if cell is not besides and self.is_up(cell)]
        if len(up) <= 1:
            return up[0] if up else None
        first, second = (up[place] for place in two_drawn([cell.gpu_capacity for cell in up]))
        load_a, load_b = self._load(first, model_key), self._load(second, model_key)
        if load_a is None or load_b is None:  # one did not answer: marked down, the other takes it
            return second if load_a is None else first
        return first if less_loaded((load_a, first.gpu_capacity), (load_b, second.gpu_capacity)) else second

    def _model_key(self, reference: str | None) -> str:
        try:
            return self.catalogue.resolve(reference).key
        except UnknownModel:  # admission says so; any cell may
            return self.catalogue.default.key

    def _load(self, cell: CellServices, model_key: str) -> Load | None:
        try:
            return cell.loads.load(model_key)
        except redis.RedisError as exc:
            if cell_unreachable(exc):
                self.mark_down(cell)
                return None
            return Load()

    def close(self) -> None:
        for cell in self.cells:
            cell.listener.close()


def build_cells(settings: Settings, catalogue: Catalogue, job_ids: JobIds) -> tuple[Cells, redis.Redis]:
    """Every cell's parts, and the API tier's own Redis client (with one cell: that cell's). The process's clock
    follows the tier's Redis (contract.redis.clock), measured again on the first cell's listener tick."""
    described = cells_of(settings)
    several = len(described) > 1 or bool(settings.cells)
    tier: redis.Redis | None = None
    buckets: TokenBuckets | TierBuckets | None = None
    if several:
        tier = connect(settings, socket_timeout=settings.redis.timeout_s, max_connections=REDIS_CONNECTIONS)
        CLOCK.follow(tier)
        buckets = TierBuckets(tier, settings.bulk.retry_s)
    built = [_build_cell(cell, catalogue, buckets, several) for cell in described]
    cells = Cells(built, job_ids, catalogue, settings.bulk.retry_s)
    return cells, tier if tier is not None else cells.first.redis


def _build_cell(
    cell: Cell, catalogue: Catalogue, buckets: TokenBuckets | TierBuckets | None, several: bool
) -> CellServices:
    settings = cell.settings
    # Bounded, and what a burst opened is closed again once idle (contract.redis.connection.IdleClosingPool).
    client = connect(
        settings,
        socket_timeout=settings.redis.timeout_s + 3.0,
        max_connections=max(REDIS_CONNECTIONS, settings.api.threads + 2),
    )  # gthread: one a thread
    if not several:
        # The process's clock reads the primary's (contract.redis.clock: every moment it writes or judges is the
        # service's); measured again on the listener's tick.
        CLOCK.follow(client)
    keys = Keys(settings.namespace)
    # Uploads over a few connections of their own: Redis keeps an upload-sized buffer on each (JobIntake.create).
    uploads = connect(settings, socket_timeout=settings.redis.timeout_s + 3.0, max_connections=UPLOAD_CONNECTIONS)
    # With bulk shards (contract.redis.shards) uploads go to them instead, over as few connections in all.
    per_shard = max(2, UPLOAD_CONNECTIONS // max(1, len(settings.bulk.redis_urls)))
    bulk = bulk_plane(settings, client, max_connections=per_shard)
    # With replicas to reach (settings.redis), a 202 waits until they hold the job: contract.redis.connection.
    # Behind Sentinel, every replica the Sentinels see up, on the primary their majority names
    # (contract.redis.replication).
    durable = durable_writes(settings.redis)
    if durable is not None:
        durable.start()
    replication = Replication(settings.redis.replicas_per_write, settings.redis.replica_timeout_ms, durable)
    # Results as stored: a read serves them unparsed (app.job_bodies); each key's cache hits charged (HitLimits).
    # The cache on its own Redis when configured: one for every cell (contract.cache.cache_plane), else this cell's.
    plane = cache_plane(settings)
    store = JobIntake(
        client,
        keys,
        settings.jobs.ttl_s,
        uploads=uploads,
        bulk=bulk,
        replication=replication,
        hits=HitLimits.of(settings),
        results_as_text=True,
        cache_plane=plane,
    )
    cache = ResultCache(client, keys, settings, plane)
    admission = Admission(settings, client, keys, store, catalogue, cache, buckets=buckets, cell=cell.name)
    clock_tick = [CLOCK.sync_if_due] if cell.index == 0 else []
    # One pub/sub listener per cell and process wakes long-polls (the callback worker relays callbacks); each
    # second it also ends the cell's jobs whose deadline passed (the CPU workers do too, more often).
    listener = JobEventListener(
        redis.Redis(connection_pool=client.connection_pool),
        keys.job_events,
        on_tick=ticks(*clock_tick, sweeper(store, admission.waiting), idle_closer([client, uploads, *bulk.clients])),
    )
    return CellServices(
        index=cell.index,
        name=cell.name,
        gpu_capacity=cell.gpu_capacity,
        settings=settings,
        redis=client,
        keys=keys,
        store=store,
        admission=admission,
        cache=cache,
        listener=listener,
        address=redis_address(settings.redis_url),
        loads=CellLoads(client, keys, settings.tenants, settings.gpu_worker.heartbeat_ttl_s),  # no read until asked
    )
