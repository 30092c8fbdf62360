"""Admission: whether the API takes a new job now, for which model, and on which tenant's queue. The one place.

A submission meets `Admission` twice. Before its body is read (`before_body`): a request whose model and size
are known (a `model=` query, or a body that is the image) is routed now and its bytes reserved, so an unknown
model or a full backlog costs no upload. After (`admit`): routed if it was not, then admitted. Where the result
cache may answer (contract.cache), the admission waits for the body: the lookup and, on a miss, the admission
are one step in Redis (contract.jobs.intake's `_ANSWER_OR_ADMIT`), and a hit is a job ended already, admitted by
nothing (it adds nothing to wait). The `Reservation` a submission holds says what was admitted, on which
tenant's queue its job goes (the API key's own while a CPU worker takes them), and is given back if the job is
not stored after all.

What is checked: one step in Redis (contract.budget's admit) checks a model's backlog (jobs waiting for a CPU or a
GPU worker) and reserves the upload's bytes against the model's budget and the total. Over the backlog or the
model's budget: 429, that model is overloaded (others are served). Over the total, or Redis past
`store_full_ratio` of its `maxmemory`: 503, the store is full for everyone. Either way `Retry-After` says how
long the waiting work takes to drain by enough, at the rate the GPU workers have answered this model's jobs
lately (their heartbeats), not a constant: a store that stays full says so.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis

from app import metrics
from app.problems import Problem
from contract import budget
from contract.cache import HIT, MISS, ResultCache
from contract.clock import now as service_now
from contract.heartbeat import live_heartbeats
from contract.jobs.backlog import queue_depths
from contract.jobs.intake import CacheHit, JobIntake
from contract.keys import Keys
from contract.models import Catalogue, ModelSpec, UnknownModel
from contract.settings import Settings
from contract.timebill import FINISHED_AT, RECEIVED_AT, SUBMITTED_AT, compute_time_bill

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60  # also what a model with no GPU worker answering it gets
LOOK_S = 1.0  # how stale Redis's memory figures and the served API keys may be: one read per process a second

T = TypeVar("T")


class ReadAtMostEvery(Generic[T]):
    """A figure read from Redis at most once per `interval_s` in this process; calls in between, from any
    thread, get the last reading (the first call reads)."""

    def __init__(self, interval_s: float, read: Callable[[], T], initial: T) -> None:
        self.interval_s, self.read = interval_s, read
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._value = initial

    def get(self) -> T:
        now = time.monotonic()
        with self._lock:
            if now - self._read_at < self.interval_s:
                return self._value
            self._read_at = now
        value = self.read()
        with self._lock:
            self._value = value
        return value


class RedisMemory:
    """Redis's used memory against its maxmemory, read at most once a second per process."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._share = ReadAtMostEvery(LOOK_S, self._read, 0.0)

    def share(self) -> float:
        """used_memory / maxmemory (0 when Redis has no maxmemory)."""
        return self._share.get()

    def _read(self) -> float:
        info: Any = self.redis.info("memory")
        limit = int(info.get("maxmemory") or 0)
        return int(info.get("used_memory") or 0) / limit if limit else 0.0


class ServedTenants:
    """The API keys whose own CPU queues a live CPU worker takes (Keys.cpu_tenants, refreshed by the
    workers' heartbeats), read at most once a second per process. A key added to the API's config before
    the workers were restarted with it has no such worker: its jobs go to the shared queues meanwhile,
    where they are served, rather than to queues nobody takes."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: float) -> None:
        self.redis, self.keys, self.ttl_s = client, keys, ttl_s
        self._served: ReadAtMostEvery[frozenset[str]] = ReadAtMostEvery(LOOK_S, self._read, frozenset())
        self._warned: set[str] = set()

    def served(self, tenant: str) -> bool:
        if tenant in self._served.get():
            return True
        if tenant not in self._warned:  # a set's add is atomic: at worst two threads both warn once
            self._warned.add(tenant)
            log.warning(
                "no live CPU worker takes API key %s's own queues (is its config older than the "
                "API's?): its jobs share the common queues meanwhile",
                tenant,
            )
        return False

    def _read(self) -> frozenset[str]:
        seen: Any = self.redis.hgetall(self.keys.cpu_tenants)
        oldest = service_now() - self.ttl_s
        return frozenset(key.decode() for key, at in seen.items() if float(at) >= oldest)


@dataclass
class Reservation:
    """One submission's admission: the model it was routed to, the bytes reserved for it until its job is stored
    with them, and the tenant whose queue the job goes on (as counted when it was admitted)."""

    client_id: str = ""  # the API key's id ("" without keys)
    spec: ModelSpec | None = None
    size: int = 0  # bytes reserved, given back unless a stored job holds them
    admitted: bool = False
    cached: bool = False  # the result cache may answer it: admitted with the lookup
    tenant: str = ""  # whose CPU queue: the key's own, or "" (the shared ones)

    def stored(self) -> None:
        """Its job is stored and holds the bytes now: whatever ends the job gives them back."""
        self.size = 0


class Admission:
    """Routing, the reservation, the result cache's lookup, and the verdicts of the budgets, for one API process."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        keys: Keys,
        store: JobIntake,
        catalogue: Catalogue,
        cache: ResultCache,
    ) -> None:
        self.settings, self.redis, self.keys = settings, client, keys
        self.store, self.catalogue, self.cache = store, catalogue, cache
        self.waiting = budget.WaitingBytes(client, keys)
        self.memory = RedisMemory(client)
        self.tenants = ServedTenants(client, keys, settings.celery.heartbeat_ttl_s)

    def route(self, reference: str | None) -> ModelSpec:
        """The model `model=reference` reaches (None: the default); 404 when none does."""
        try:
            return self.catalogue.resolve(reference)
        except UnknownModel as exc:
            raise Problem(
                404, "model-not-found", "Model not found", f"{exc}; served: {', '.join(exc.served)}", models=exc.served
            ) from None

    def before_body(
        self, reference: str | None, declared: int | None, model_in_form: bool, client_id: str
    ) -> Reservation:
        """A submission whose model and size are known before its body is read (`declared`: its Content-Length;
        `model_in_form`: a multipart body may name the model itself) is routed and its body's bytes reserved now;
        the job's own are given back when it is stored. Where the cache may answer, admission waits for the body."""
        reservation = Reservation(client_id=client_id)
        if declared is not None and not model_in_form:
            spec = self.route(reference)
            if self.cache.enabled_for(spec):
                reservation.spec = spec
            else:
                self._take(reservation, spec, declared)
        return reservation

    def route_body(self, reservation: Reservation, reference: str | None, size: int, cache: bool | None) -> ModelSpec:
        """After the body: routed now if it was not (a model named in the form, or a body of unknown length), and
        admitted as it is unless the cache may answer it (`cache`: the request's option), whose lookup admits it."""
        if reservation.spec is None:
            reservation.spec = self.route(reference)
        spec = reservation.spec
        reservation.cached = cache is not False and self.cache.enabled_for(spec)
        if not reservation.admitted and not reservation.cached:
            self._take(reservation, spec, size)
        return spec

    def admit(
        self, reservation: Reservation, job_id: str, data: bytes, fields: dict[str, Any]
    ) -> tuple[CacheHit, dict[str, Any], dict[str, float]] | None:
        """For a submission the cache may answer, the lookup and, on a miss, its admission, in one step. On a hit:
        (the hit, the job's fields as stored, its time bill): the job is over already. On a miss: None, admitted,
        and `fields` say so (cache, cache_key). A submission admitted before: None, nothing done."""
        if not reservation.cached:
            return None
        spec = reservation.spec
        assert spec is not None  # routed by route_body
        digest = self.cache.digest(data, spec, fields["options"], reservation.client_id)
        now = service_now()
        answered = {**fields, SUBMITTED_AT: now, "cache": HIT}
        timings = compute_time_bill({RECEIVED_AT: fields[RECEIVED_AT], SUBMITTED_AT: now, FINISHED_AT: now})
        request = self._request(reservation, spec, len(data))
        outcome = self.store.answer_or_admit(job_id, answered, digest, self.settings.cache.ttl_s, timings, request)
        if isinstance(outcome, CacheHit):
            metrics.CACHE_LOOKUPS.labels(spec.name, spec.version, HIT).inc()
            return outcome, answered, timings
        metrics.CACHE_LOOKUPS.labels(spec.name, spec.version, MISS).inc()
        self._settle(spec, request, outcome)  # refused: the problem says by which limit
        reservation.size, reservation.admitted = len(data), True
        fields.update(cache=MISS, cache_key=digest)
        return None

    def give_back(self, reservation: Reservation) -> None:
        """The bytes of a submission refused after its reservation (a bad option, not an image, Redis away)."""
        if reservation.spec is None or not reservation.size:
            return
        key, size = reservation.spec.key, reservation.size
        try:
            self.waiting.release(key, size)
        except redis.RedisError:  # Redis away: the answer says so already; given back once it answers again
            log.warning("could not give back %d reserved bytes of model %s yet", size, key)
            self.waiting.release_later(key, size)
        reservation.size = 0

    def _take(self, reservation: Reservation, spec: ModelSpec, size: int) -> None:
        """Reserve `size` bytes for a new job of `spec`'s, or refuse with a problem."""
        reservation.spec = spec
        request = self._request(reservation, spec, size)
        self._settle(spec, request, self.waiting.admit(*request))
        reservation.size, reservation.admitted = size, True

    def _request(self, reservation: Reservation, spec: ModelSpec, size: int) -> budget.AdmissionRequest:
        """What a new job of `spec`'s asks of the budgets, for its API key (whose queue, the reservation's tenant,
        is decided here); a 503 at once while Redis is past `store_full_ratio` of its memory."""
        pressure = self.settings.backpressure
        if self.memory.share() >= pressure.store_full_ratio:
            raise Problem(
                503,
                "store-full",
                "Service unavailable",
                "the job store is full; retry later",
                headers={"Retry-After": str(self._retry_after(spec, 1.0))},
            )
        tenant = reservation.client_id
        if tenant and not self.tenants.served(tenant):
            tenant = ""
        reservation.tenant = tenant
        limit = self.settings.max_backlog(spec)
        share = max(1, int(limit * self.settings.auth.max_backlog_share)) if tenant else limit
        return budget.AdmissionRequest(
            spec.key,
            size,
            limit,
            self.settings.max_waiting_bytes(spec),
            pressure.max_total_waiting_bytes,
            tenant,
            self.settings.tenants,
            share,
        )

    def _settle(self, spec: ModelSpec, request: budget.AdmissionRequest, verdict: budget.Admission) -> None:
        """Nothing when `verdict` admitted the job; else the problem that says which limit refused it."""
        if verdict.verdict == budget.ADMITTED:
            return
        size = request.size
        share = request.max_tenant_backlog or request.max_backlog
        if verdict.verdict == budget.OVER_TENANT_BACKLOG:
            retry = self._retry_after(spec, (verdict.backlog - share + 1) / max(1, verdict.backlog))
            raise Problem(
                429,
                "overloaded",
                "Too many requests",
                f"{verdict.backlog} of your jobs are waiting for model {spec.key} (your share of its "
                f"backlog is {share}); retry later",
                headers={"Retry-After": str(retry)},
            )
        if verdict.verdict == budget.OVER_BACKLOG:
            limit = self.settings.max_backlog(spec)
            retry = self._retry_after(spec, (verdict.backlog - limit + 1) / max(1, verdict.backlog))
            raise Problem(
                429,
                "overloaded",
                "Too many requests",
                f"{verdict.backlog} jobs are waiting for model {spec.key} (limit {limit}); retry later",
                headers={"Retry-After": str(retry)},
            )
        if verdict.verdict == budget.OVER_MODEL_BYTES:
            limit = self.settings.max_waiting_bytes(spec)
            retry = self._retry_after(spec, (verdict.model_bytes + size - limit) / max(1, verdict.model_bytes))
            raise Problem(
                429,
                "overloaded",
                "Too many requests",
                f"model {spec.key} has {verdict.model_bytes} bytes of images waiting (limit {limit}); retry later",
                headers={"Retry-After": str(retry)},
            )
        limit = self.settings.backpressure.max_total_waiting_bytes
        retry = self._retry_after(spec, (verdict.all_bytes + size - limit) / max(1, verdict.all_bytes))
        raise Problem(
            503,
            "store-full",
            "Service unavailable",
            f"{verdict.all_bytes} bytes of images are waiting (limit {limit}); retry later",
            headers={"Retry-After": str(retry)},
        )

    def _retry_after(self, spec: ModelSpec, share: float) -> int:
        """Seconds until `share` of the model's waiting work has drained at its recent rate, within
        [backpressure.retry_after_s, MAX_RETRY_AFTER_S]; the most when no GPU worker answers it."""
        least = self.settings.backpressure.retry_after_s
        try:
            depths = queue_depths(self.redis, self.keys, [spec.key], self.settings.tenants)
            backlog = sum(depths[spec.key].values())
            rate = self.drain_rate(spec.key)
        except redis.RedisError:
            return least
        if rate <= 0:
            return MAX_RETRY_AFTER_S
        return int(min(MAX_RETRY_AFTER_S, max(least, math.ceil(max(share, 0.0) * backlog / rate))))

    def drain_rate(self, model_key: str) -> float:
        """Jobs a second the live GPU workers answered for this model over their recent window."""
        rate = 0.0
        for beat in live_heartbeats(self.redis, self.keys, self.settings.gpu_worker.heartbeat_ttl_s):
            window = float(beat.stats.get("window_s") or 0.0)
            for model in beat.served_models():
                if model.key == model_key and window > 0:
                    rate += float(model.stats.get("jobs", 0)) / window
        return rate
