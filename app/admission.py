"""Admission: whether the API takes a new request or job now, for which model, and on which tenant's queue. The
one object the API asks is `Admission`; the Lua it runs is contract's (contract.admission.budget's admit,
contract.jobs.intake's take_in, contract.admission.token_bucket).

A request meets `Admission` first for its rate (`limit_rate`, and `failed_authentication` for an address that
failed to authenticate): a key over `auth.rate_per_s` is a 429. A submission then meets it twice. Before its body
is read (`before_body`): a request whose model and size are known (a `model=` query, or a body that is the image)
is routed now and its bytes reserved, so an unknown model or a full backlog costs no upload. After, in one call
(`take`: `route_body`, then `take_in`): routed if it was not, then admitted with its job made, in one step
(contract.jobs.intake's take_in). Where the result cache may answer (contract.cache), the
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

An upload expensive to decode is charged to its API key in the step that makes its job (`take_in`,
contract.admission.decode_share): a key whose charged decodes in flight would pass
`auth.max_decode_bytes_in_flight` is refused.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from app import metrics
from app.admission_readings import RedisMemory, ServedTenants
from app.admission_verdicts import Verdicts, decode_share_refusal, retry_after_header
from app.byte_shares import key_byte_shares
from app.problems import Problem
from app.tier_buckets import TierBuckets
from contract.admission import budget
from contract.admission.decode_share import CHARGED_FROM, decode_cost
from contract.admission.token_bucket import TokenBuckets
from contract.cache import HIT, MISS, ResultCache
from contract.jobs.hits import HitLimited
from contract.jobs.intake import CacheHit, DecodeCharge, DecodeRefused, HitTerms, JobIntake, NewJob
from contract.jobs.timebill import FINISHED_AT, RECEIVED_AT, SUBMITTED_AT, compute_time_bill
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.redis.replication import NotReplicated
from contract.settings import Settings
from contract.settings.models import Catalogue, ModelSpec, UnknownModel

log = logging.getLogger(__name__)


Route = tuple[str | None, int, bool | None]  # take's: the model's reference, the body's size, the cache option
Taken = tuple[CacheHit, dict[str, Any], dict[str, float]]  # a cache hit's: the hit, the job's fields, its time bill
# Admission.take's hand-off to the caller's part: the job's id, its upload, its fields, its task for a queue
TakeIn = Callable[[str, bytes, dict[str, Any], Callable[[str], tuple[str, bytes]]], Taken | None]
T = TypeVar("T")


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
        source may fail only so often (one address guessing keys as fast as it can), and so may all of them together
        (a guesser spread over many addresses gets a bucket each; docs/security.md). The 429 to answer instead once
        either is over."""
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

    def take(self, reservation: Reservation, route: Route, job_for: Callable[[ModelSpec, TakeIn], T]) -> T:
        """The reservation's life after the body, in one call: routed (route_body; `route`: the model's reference,
        the body's size, the cache option), then `job_for(spec, take_in)` makes its job (the route's checks that need
        the model, the store's id and fields) and hands it to `take_in`, which takes it in on this reservation
        (take_in). The reservation stays here: the caller's part sees the model it was routed to, not it."""
        spec = self.route_body(reservation, *route)

        def take_in(
            job_id: str, data: bytes, fields: dict[str, Any], task_for: Callable[[str], tuple[str, bytes]]
        ) -> Taken | None:
            return self.take_in(reservation, job_id, data, fields, task_for)

        return job_for(spec, take_in)

    def take_in(
        self,
        reservation: Reservation,
        job_id: str,
        data: bytes,
        fields: dict[str, Any],
        task_for: Callable[[str], tuple[str, bytes]],
    ) -> Taken | None:
        """The submission's job made, in one step in Redis (JobIntake.take_in): the result cache's lookup where it
        may answer, the budgets' admission unless its bytes were reserved before its body was read, its decode's
        charge to its key, the job and its task (`task_for(queue)`: the Celery queue's list and the message). On a
        hit: (the hit, the job's fields as stored, its time bill): the job is over already. Made: None, and
        `fields` are the record's. Refused: the problem that says by which limit, nothing kept."""
        spec = reservation.spec
        assert spec is not None  # routed by route_body
        request = None if reservation.admitted else self._request(reservation, spec, len(data))
        tenant = request.tenant if request is not None else reservation.tenant
        hit = None
        if reservation.cached:
            digest = self.cache.digest(data, spec, fields["options"], reservation.client_id)
            now = service_now()
            answered = {**fields, SUBMITTED_AT: now, "cache": HIT}
            timings = compute_time_bill({RECEIVED_AT: fields[RECEIVED_AT], SUBMITTED_AT: now, FINISHED_AT: now})
            hit = HitTerms(digest, self.settings.cache.ttl_s, answered, timings, reservation.client_id)
            fields.update(cache=MISS, cache_key=digest)
        decode = self._decode_charge(reservation.client_id, data, fields["deadline_at"])
        if decode is not None:
            fields["decode_cost"] = decode.cost
        queue = self.keys.preprocess_queue(spec.key, tenant)
        fields.update({SUBMITTED_AT: service_now(), "queue": queue})
        ttl_s = self.settings.jobs.upload_ttl_s
        job = NewJob(job_id, data, ttl_s, fields, task_for(queue), request, reservation.size, decode=decode)
        try:
            outcome = self.store.take_in(job, hit)
        except NotReplicated:
            self.stored(reservation)  # the job held its bytes, and its withdrawal gave them back
            raise
        if isinstance(outcome, CacheHit):
            assert hit is not None
            metrics.CACHE_LOOKUPS.labels(spec.name, spec.version, HIT, self.cell).inc()
            return outcome, dict(hit.fields), dict(hit.timings)
        if isinstance(outcome, HitLimited):  # every accepted request is charged: its answer to its key's bucket
            detail = (
                f"key {reservation.client_id!r}'s answers (computed and cache hits) stored their "
                "jobs.answer_bytes_per_key; retry later"
            )
            raise Problem(429, "rate-limited", "Too many requests", detail, retry_after_header(outcome.retry_after_ms))
        if hit is not None:
            metrics.CACHE_LOOKUPS.labels(spec.name, spec.version, MISS, self.cell).inc()
        if isinstance(outcome, DecodeRefused):
            assert decode is not None
            raise decode_share_refusal(outcome.held, decode.cost, decode.share)
        if isinstance(outcome, budget.BudgetVerdict):
            assert request is not None
            self.verdicts.settle(spec, request, outcome)  # refused: the problem says by which limit
            raise AssertionError(f"take_in refused with {outcome.verdict!r}")  # settle raises on a refusal
        if request is not None:
            reservation.admit(request)
        self.stored(reservation)  # the job holds its bytes now
        return None

    def _decode_charge(self, client_id: str, data: bytes, deadline_at: float) -> DecodeCharge | None:
        """An expensive upload's decode, to be charged to its API key with its job (contract.admission.decode_share);
        None: nothing to charge (a cheap image, no keys, no limit)."""
        limit = self.settings.auth.max_decode_bytes_in_flight
        cost = decode_cost(data) if client_id and limit > 0 else 0
        if cost < CHARGED_FROM:
            return None
        return DecodeCharge(cost, limit, deadline_at + self.settings.celery.task_time_limit_s)

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
