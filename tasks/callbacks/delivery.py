"""A job's callback delivered: one attempt per task, and where the job id waits next (delivered, retried with
backoff, held for a tenant's slot, or given up). The POST is tasks.callbacks.http_client's (the URL checked again at
delivery: contract.callbacks), its signature contract.callbacks.callback_signature's; why the callback path is a loop
(outbox, relay, Celery, retry set) is in docs/architecture.md.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

import redis

from contract.callbacks import (
    CallbackRefused,
    CallbackTarget,
    callback_secret,
    parse_callback_url,
    resolve_callback_url,
)
from contract.callbacks.callback_signature import signed_headers
from contract.documents import job_document
from contract.jobs.record import JobRecord, JobStore
from contract.library import Step
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.settings import Settings
from contract.settings.sections import SettingsError
from tasks.callbacks.http_client import Deadline, DeliveryFailed, bounded_resolver, post_within
from tasks.callbacks.slots import TenantSlots

log = logging.getLogger(__name__)


def backoff_s(attempts: int, base_s: float, max_s: float, jitter: float, draw: float) -> float:
    """The wait after `attempts` failed deliveries: base * 2**(attempts-1), at most max_s, scaled by a factor
    within [1 - jitter, 1 + jitter] (`draw` in [0, 1) picks it)."""
    plain = min(max_s, base_s * 2.0 ** max(0, attempts - 1))
    return plain * (1.0 - jitter + 2.0 * jitter * draw)


# What a job's callback state is, and where it waits next: the library's `record_callback_state`
# (contract/library/callbacks.lua, where its keys and arguments are named). The dead letter keeps what a read and a
# redelivery need (the job's document, its owner and callback), not the stages' own bookkeeping (DEAD_LETTER_DROPS:
# the library's list, which a test holds to this one).
DEAD_LETTER_DROPS = (
    *("claim", "queue", "resent", "cache_key", "decode_cost", "media_type", "bytes", "submitted_at"),
    *("cpu_started_at", "decode_ms", "resize_ms", "backpressure_ms", "pushed_at"),  # the time bill is made
)
_RECORD_STATE = Step("record_callback_state")


class CallbackSender:
    """One delivery attempt of a job's callback, and what happens after it: delivered; retried later (the job id
    waits in the scheduled set, which the relays move back to the outbox when due: no Celery countdown, which
    the Redis transport would hand out again after its visibility timeout); or given up, the dead letter.

    Each attempt is recorded as `delivering` before the POST. The task is acknowledged only once it ran
    (acks_late): a worker that dies in the middle, even right after the receiver answered, has the task given
    back (tasks.hop.recovery) and the callback is posted again, with the same X-Imgserve-Delivery-Id; the receiver
    drops the repeat (the receiver in docs/operations.md does, by job id and status). It never stays `pending`.

    An attempt holds its thread for `callbacks.deadline_s` at most, whatever the receiver does (Celery's time
    limits are not enforced by the threads pool: the attempt bounds itself), and only once it has one of its
    tenant's slots (tasks.callbacks.slots): a tenant's slow receivers hold that many threads, never all of them."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.service_settings = settings
        self.settings = settings.callbacks
        self.ttl_s = settings.jobs.ttl_s
        self.max_ttl_s = settings.jobs.max_ttl_s
        self.redis = client
        self.keys = Keys(settings.namespace)
        self.store = JobStore(client, self.keys, settings.jobs.ttl_s)
        self.slots = TenantSlots(client, self.keys, settings.callbacks.max_per_tenant, settings.callbacks.deadline_s)

    def deliver(self, job_id: str) -> str:
        """One attempt: 'delivered', 'retrying', 'failed' (given up), 'held' (its tenant has every slot in use: it
        waits in Redis, no attempt counted) or 'gone' (no job, no callback)."""
        record = self.store.load(job_id)
        if record is None or not record.get("callback_url"):
            return "gone"
        state = dict(record.get("callback") or {})
        if state.get("status") == "delivered":
            return "delivered before"  # a task given back after the delivery was recorded
        tenant = tenant_of(record)
        token = self.slots.take(tenant, job_id)
        if token is None:
            return "held"
        try:
            return self._attempt(job_id, record, state)
        finally:
            self.slots.give_back(tenant, token)

    def _attempt(self, job_id: str, record: JobRecord, state: dict[str, Any]) -> str:
        attempts = int(state.get("attempts", 0)) + 1
        first_at = float(state.get("first_at") or service_now())
        delivery_id = state.get("delivery_id") or f"{job_id}.{record.get('status')}"
        base = {"attempts": attempts, "first_at": first_at, "delivery_id": delivery_id}
        # attempt_at: a redelivery request during the attempt answers with it (contract.jobs.ending)
        delivering = {"status": "delivering", "last_error": state.get("last_error"), "attempt_at": service_now()}
        self._record(job_id, {**base, **delivering})
        body = json.dumps(job_document(record), separators=(",", ":")).encode()
        # The receiver checks this against its own clock, not the service's: the host's, NTP's, is the one to show.
        timestamp = str(int(time.time()))
        deadline = Deadline(self.settings.deadline_s, self.settings.timeout_s)
        try:
            secret = callback_secret(self.service_settings, record.get("owner"))
            if not secret:
                raise CallbackRefused("no callback secret is configured for this job's API key")
            target = resolve_callback_url(
                record["callback_url"], self.settings.allow_hosts, resolve=bounded_resolver(deadline)
            )
            self._post(target, job_id, body, timestamp, secret, delivery_id, deadline)
        except CallbackRefused as exc:
            # The job's owner reads last_error: what the lookup found goes to this log only (as at submit).
            log.warning("callback refused: %s", exc, extra={"job_id": job_id})
            return self._failed(job_id, base, exc.public[:300], self._lapses_at(record), retry=False)
        except (DeliveryFailed, SettingsError) as exc:
            retry = isinstance(exc, DeliveryFailed)
            return self._failed(job_id, base, str(exc)[:300], self._lapses_at(record), retry=retry)
        # delivered_at: a redelivery request moments later answers with this one (contract.jobs.ending)
        self._record(job_id, {**base, "status": "delivered", "last_error": None, "delivered_at": service_now()})
        return "delivered"

    def _lapses_at(self, record: JobRecord) -> float:
        """The last moment the job's record may live, whatever its callback: `jobs.max_ttl_s` from its
        submission. Retries stop there; the dead letter is the record, kept until then at most."""
        return float(record.get("received_at") or record.get("finished_at") or service_now()) + self.max_ttl_s

    def _failed(self, job_id: str, base: dict[str, Any], error: str, lapses_at: float, retry: bool) -> str:
        now = service_now()
        attempts = int(base["attempts"])
        within = now - float(base["first_at"]) < self.settings.retry_for_s
        wait = backoff_s(
            attempts, self.settings.backoff_base_s, self.settings.backoff_max_s, self.settings.jitter, random.random()
        )
        retriable = retry and attempts < self.settings.max_attempts and within
        if retriable and now + wait < lapses_at:
            self._record(
                job_id,
                {**base, "status": "retrying", "last_error": error, "next_attempt_at": now + wait},
                place="scheduled",
                score=now + wait,
                keep_s=min(int(wait) + self.ttl_s, int(lapses_at - now)),
            )
            return "retrying"
        if retriable:  # the next attempt would find no record
            error = f"{error} (not retried: the job's record lapses first, jobs.max_ttl_s)"[:300]
        keep_s = min(self.ttl_s, int(lapses_at - now))
        self._record(job_id, {**base, "status": "failed", "last_error": error}, place="dead", score=now, keep_s=keep_s)
        return "failed"

    def _post(
        self,
        target: CallbackTarget,
        job_id: str,
        body: bytes,
        timestamp: str,
        secret: str,
        delivery_id: str,
        deadline: Deadline,
    ) -> None:
        headers = signed_headers(secret, timestamp, job_id, delivery_id, body)
        status = post_within(target, body, headers, deadline, self.settings.max_response_bytes)
        if not 200 <= status < 300:
            raise DeliveryFailed(f"receiver answered {status}")

    def _record(self, job_id: str, state: dict[str, Any], place: str = "", score: float = 0.0, keep_s: int = 0) -> None:
        """The delivery's state on the job and where the job id waits next, in one step."""
        _RECORD_STATE(
            self.redis,
            [self.keys.job(job_id), self.keys.callback_scheduled, self.keys.callback_dead],
            [job_id, json.dumps(state), place, score, keep_s],
        )


def tenant_of(record: Mapping[str, Any]) -> str:
    """Whose slots a job's callback takes: its API key's; without one, its receiving host's."""
    if record.get("owner"):
        return f"key:{record['owner']}"
    try:
        return "host:" + parse_callback_url(record["callback_url"]).host
    except CallbackRefused:
        return "host:"  # refused at its attempt anyway
