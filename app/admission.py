"""Admission: whether the API takes a new request or job now, for which model, and on which tenant's queue. The
one object the API asks is `Admission`; the Lua it runs is contract's (contract.admission.budget's admit,
contract.jobs.intake's `_ANSWER_OR_ADMIT`, contract.admission.token_bucket).

A request meets `Admission` first for its rate (`limit_rate`, and `failed_authentication` for an address that
failed to authenticate): a key over `auth.rate_per_s` is a 429. A submission then meets it twice. Before its body
is read (`before_body`): a request whose model and size are known (a `model=` query, or a body that is the image)
is routed now and its bytes reserved, so an unknown model or a full backlog costs no upload. After (`route_body`,
then `admit`): routed if it was not, then admitted. Where the result cache may answer (contract.cache), the
admission waits for the body: the lookup and, on a miss, the admission are one step in Redis, and a hit is a job
ended already, admitted by nothing (it adds nothing to wait). The `Reservation` a submission holds says what was
admitted, on which tenant's queue its job goes (the API key's own while a CPU worker takes them); `stored` hands
its bytes to the stored job, `give_back` returns them if the job is not stored after all. Only `Admission`
changes a reservation, through its methods.

What is checked: one step in Redis (contract.admission.budget's admit) checks a model's backlog (jobs waiting for a CPU
or a GPU worker) and reserves the upload's bytes against the model's budget and the total. Over the backlog or the
model's budget: 429, that model is overloaded (others are served). Over the total, or Redis past
`store_full_ratio` of its `maxmemory`: 503, the store is full for everyone. Either way `Retry-After` says how
long the waiting work takes to drain by enough, at the rate the GPU workers answer this model's jobs now
(app.drain: measured while refusals come, not averaged over an idle past), not a constant: a store that
stays full says so. The refusals, and that wait, are written by app.admission_verdicts.

An upload expensive to decode is charged to its API key before its job is queued (`charge_decode`,
contract.admission.decode_share): a key whose charged decodes in flight would pass
`auth.max_decode_bytes_in_flight` is refused.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

import redis

from app import metrics
from app.admission_readings import RedisMemory, ServedTenants
from app.admission_verdicts import Verdicts, decode_share_refusal, retry_after_header
from app.byte_shares import key_byte_shares
from app.problems import Problem
from app.tier_buckets import TierBuckets
from contract.admission import budget
from contract.admission.decode_share import CHARGED_FROM, DecodeShare, decode_cost
from contract.admission.token_bucket import TokenBuckets
from contract.cache import HIT, MISS, ResultCache
from contract.jobs.hits import HitLimited
from contract.jobs.intake import CacheHit, JobIntake
from contract.jobs.timebill import FINISHED_AT, RECEIVED_AT, SUBMITTED_AT, compute_time_bill
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.settings import Settings
from contract.settings.models import Catalogue, ModelSpec, UnknownModel

log = logging.getLogger(__name__)


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

    # Its state changes only here, each method one event of its life; Admission calls them.

    def route_to(self, spec: ModelSpec, cached: bool = False) -> None:
        """Routed to `spec`; `cached`: the result cache may answer it (its lookup admits it)."""
        self.spec, self.cached = spec, cached

    def admit(self, request: budget.AdmissionRequest) -> None:
        """The budgets took `request`: its bytes are reserved, its job goes on `request.tenant`'s queue."""
        self.size, self.tenant, self.admitted = request.size, request.tenant, True

    def release(self) -> None:
        """Its bytes are no longer this reservation's to give back: a stored job holds them, or they were given
        back."""
        self.size = 0


class Admission:
    """What the API asks before it takes a request or a job, for one API process: the rate limit, routing, the
    reservation, the result cache's lookup or the admission, and the budgets' verdict (settled into a problem)."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        keys: Keys,
        store: JobIntake,
        catalogue: Catalogue,
        cache: ResultCache,
        buckets: TokenBuckets | TierBuckets | None = None,
        cell: str = "default",  # its cell's name: the `cell` label of what it counts
    ) -> None:
        self.settings, self.redis, self.keys, self.cell = settings, client, keys, cell
        self.store, self.catalogue, self.cache = store, catalogue, cache
        self.waiting = budget.WaitingBytes(client, keys)
        self.memory = RedisMemory(client)
        self.tenants = ServedTenants(client, keys, settings.celery.heartbeat_ttl_s)
        self.verdicts = Verdicts(settings, client, keys)  # the refusals, and when to come back
        self.buckets = buckets or TokenBuckets(client)  # with cells, the API tier's (app.tier_buckets)
        self.decode_share = DecodeShare(client, keys)  # expensive decodes per key in flight (charge_decode)

    def limit_rate(self, client_id: str) -> None:
        """A token from the key's bucket (`auth.rate_per_s`, `auth.burst`), or a 429: the key is over its rate."""
        auth = self.settings.auth
        if auth.rate_per_s <= 0:
            return
        taken = self.buckets.take(self.keys.rate_bucket(client_id), auth.rate_per_s, auth.burst)
        if not taken.allowed:
            raise Problem(
                429,
                "rate-limited",
                "Too many requests",
                f"key {client_id!r} is over {auth.rate_per_s:g} requests/s",
                headers=retry_after_header(taken.retry_after_ms),
            )

    def failed_authentication(self, address: str) -> Problem | None:
        """A failed authentication from `address` counted (`auth.failed_per_s`, `auth.failed_burst`; an IPv6 address
        as its /64, which one host holds whole), then among every address's (`auth.failed_total_per_s`): each
        source may fail only so often (300 guesses ran at 480/s, all 401), and so may all of them together (40
        loopback addresses got 40 buckets). The 429 to answer instead once either is over."""
        auth = self.settings.auth
        for source, per_s, burst in (
            (failure_source(address), auth.failed_per_s, auth.failed_burst),
            (ALL_SOURCES, auth.failed_total_per_s, auth.failed_total_burst),
        ):
            if per_s <= 0:
                continue
            taken = self.buckets.take(self.keys.auth_failures(source), per_s, burst)
            if not taken.allowed:
                return Problem(
                    429,
                    "too-many-failed-authentications",
                    "Too many requests",
                    "too many failed authentications from this address, or from all of them; retry later",
                    headers=retry_after_header(taken.retry_after_ms),
                )
        return None

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
                reservation.route_to(spec)
            else:
                self._take(reservation, spec, declared)
        return reservation

    def route_body(self, reservation: Reservation, reference: str | None, size: int, cache: bool | None) -> ModelSpec:
        """After the body: routed now if it was not (a model named in the form, or a body of unknown length), and
        admitted as it is unless the cache may answer it (`cache`: the request's option), whose lookup admits it."""
        spec = reservation.spec if reservation.spec is not None else self.route(reference)
        reservation.route_to(spec, cached=cache is not False and self.cache.enabled_for(spec))
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
        outcome = self.store.answer_or_admit(
            job_id, answered, digest, self.settings.cache.ttl_s, timings, request, reservation.client_id
        )
        if isinstance(outcome, CacheHit):
            metrics.CACHE_LOOKUPS.labels(spec.name, spec.version, HIT, self.cell).inc()
            return outcome, answered, timings
        if isinstance(outcome, HitLimited):  # every accepted request is charged: a hit to its key's bucket
            detail = f"key {reservation.client_id!r}'s cache hits stored their cache.hit_bytes_per_key; retry later"
            raise Problem(429, "rate-limited", "Too many requests", detail, retry_after_header(outcome.retry_after_ms))
        metrics.CACHE_LOOKUPS.labels(spec.name, spec.version, MISS, self.cell).inc()
        self.verdicts.settle(spec, request, outcome)  # refused: the problem says by which limit
        reservation.admit(request)
        fields.update(cache=MISS, cache_key=digest)
        return None

    def charge_decode(self, client_id: str, job_id: str, data: bytes, deadline_at: float) -> int:
        """An expensive upload's decode charged to its API key before its job is queued
        (contract.admission.decode_share): the
        bytes charged to `client_id` for `job_id` (0: none, a cheap image or no keys), or a 429 when the key's
        charged decodes in flight would pass `auth.max_decode_bytes_in_flight` with it."""
        limit = self.settings.auth.max_decode_bytes_in_flight
        cost = decode_cost(data) if client_id and limit > 0 else 0
        if cost < CHARGED_FROM:
            return 0
        lapse_at = deadline_at + self.settings.celery.task_time_limit_s
        taken, held = self.decode_share.take(client_id, job_id, cost, limit, service_now(), lapse_at)
        if not taken:
            raise decode_share_refusal(held, cost, limit)
        return cost

    def release_decode(self, job_id: str, charged: int) -> None:
        """A job that was not queued after all: its charge, if `charged`, goes now (else it lapses by itself)."""
        if not charged:
            return
        try:
            self.decode_share.release(job_id)
        except redis.RedisError:  # Redis away: the charge lapses after the job's deadline
            pass

    def give_back(self, reservation: Reservation) -> None:
        """The bytes of a submission refused after its reservation (a bad option, not an image, Redis away)."""
        if reservation.spec is None or not reservation.size:
            return
        key, size, owner = reservation.spec.key, reservation.size, reservation.client_id
        try:
            self.waiting.release(key, size, owner=owner)
        except redis.RedisError:  # Redis away: the answer says so already; given back once it answers again
            log.warning("could not give back %d reserved bytes of model %s yet", size, key)
            self.waiting.release_later(key, size, owner)
        reservation.release()

    def stored(self, reservation: Reservation) -> None:
        """Its job is stored and holds the bytes now (or its withdrawal gave them back): whatever ends the job
        gives them back, not this reservation."""
        reservation.release()

    def _take(self, reservation: Reservation, spec: ModelSpec, size: int) -> None:
        """Reserve `size` bytes for a new job of `spec`'s, or refuse with a problem."""
        reservation.route_to(spec)
        request = self._request(reservation, spec, size)
        self.verdicts.settle(spec, request, self.waiting.admit(*request))
        reservation.admit(request)

    def _request(self, reservation: Reservation, spec: ModelSpec, size: int) -> budget.AdmissionRequest:
        """What a new job of `spec`'s asks of the budgets, for its API key (whose queue, the request's tenant, is
        decided here and kept by the reservation once admitted); a 503 at once while Redis is past
        `store_full_ratio` of its memory."""
        pressure = self.settings.backpressure
        if self.memory.share() >= pressure.store_full_ratio:
            raise self.verdicts.store_full(spec)
        tenant = reservation.client_id
        if tenant and not self.tenants.served(tenant):
            tenant = ""
        limit = self.settings.max_backlog(spec)
        share = max(1, int(limit * self.settings.auth.max_backlog_share)) if tenant else limit
        model_share, all_share = key_byte_shares(self.settings, spec)
        return budget.AdmissionRequest(
            spec.key,
            size,
            limit,
            self.settings.max_waiting_bytes(spec),
            pressure.max_total_waiting_bytes,
            tenant,
            self.settings.tenants,
            share,
            sharded=bool(self.settings.bulk.redis_urls),
            owner=reservation.client_id,
            max_owner_model_bytes=model_share,
            max_owner_all_bytes=all_share,
        )


ALL_SOURCES = "*"  # every address's failed authentications together


def failure_source(address: str) -> str:
    """What one client's failed authentications are counted under: its IPv4 address, or its IPv6 address's /64
    (a host is given a /64 whole); anything else as it is."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)
