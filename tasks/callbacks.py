"""Signed callbacks: POST the finished job's document to the client's URL, checked again
(contract.callbacks) and connected to the address that passed the check, retried with backoff.

Signature: `X-Signature: sha256=<hex HMAC-SHA256(secret, timestamp + "." + job id
+ "." + body)>`, with `X-Imgserve-Timestamp: <unix seconds>` and
`X-Imgserve-Job-Id`. The secret is the job's API key's own
(`auth.api_keys[].callback_secret_env` or `_file`), or `callbacks.secret` when
the deployment has no keys. docs/operations.md ("Callbacks") has a receiver that refuses
stale and replayed deliveries.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

import certifi
import redis
import urllib3

from contract import jobs
from contract.callbacks import CallbackRefused, CallbackTarget, callback_secret, resolve_callback_url
from contract.documents import job_document
from contract.keys import Keys
from contract.settings import Settings, SettingsError

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Signature"
TIMESTAMP_HEADER = "X-Imgserve-Timestamp"
JOB_ID_HEADER = "X-Imgserve-Job-Id"
DELIVERY_ID_HEADER = "X-Imgserve-Delivery-Id"   # the same on every attempt of one job's callback

class DeliveryFailed(RuntimeError):
    """The receiver did not answer 2xx (or could not be reached)."""


def post_to(target: CallbackTarget, body: bytes, headers: Mapping[str, str], timeout_s: float,
            max_response_bytes: int) -> int:
    """POST to the checked address itself; the URL's host goes in Host (and SNI and the certificate
    check for https). Returns the status; reads at most max_response_bytes of the answer."""
    url = target.url
    timeout = urllib3.Timeout(connect=timeout_s, read=timeout_s)
    if url.scheme == "https":
        pool: urllib3.HTTPConnectionPool = urllib3.HTTPSConnectionPool(
            target.address, url.port, timeout=timeout, retries=False, cert_reqs="CERT_REQUIRED",
            ca_certs=certifi.where(), assert_hostname=url.host, server_hostname=url.host)
    else:
        pool = urllib3.HTTPConnectionPool(target.address, url.port, timeout=timeout, retries=False)
    try:
        response = pool.urlopen("POST", url.target, body=body, headers={**headers, "Host": url.host_header},
                                redirect=False, retries=False, preload_content=False, assert_same_host=False)
        try:
            response.read(max_response_bytes)
            return response.status
        finally:
            response.release_conn()
    except urllib3.exceptions.HTTPError as exc:
        raise DeliveryFailed(f"cannot reach the receiver: {exc}") from exc
    finally:
        pool.close()


def sign(secret: str, timestamp: str, job_id: str, body: bytes) -> str:
    message = f"{timestamp}.{job_id}.".encode() + body
    return "sha256=" + hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def backoff_s(attempts: int, base_s: float, max_s: float, jitter: float, draw: float) -> float:
    """The wait after `attempts` failed deliveries: base * 2**(attempts-1), at most max_s, scaled by a factor
    within [1 - jitter, 1 + jitter] (`draw` in [0, 1) picks it)."""
    plain = min(max_s, base_s * 2.0 ** max(0, attempts - 1))
    return plain * (1.0 - jitter + 2.0 * jitter * draw)


# KEYS[1] job hash, KEYS[2] the scheduled set, KEYS[3] the dead set; ARGV[1] the job id, ARGV[2] the callback
# state (JSON), ARGV[3] 'scheduled' | 'dead' | '' (where the job id waits next), ARGV[4] its score, ARGV[5] the
# least TTL the record must keep (a callback retried for hours needs its job). A job hash that expired meanwhile
# is not recreated by a late write. Returns 1 written, 0 gone.
_RECORD_STATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'callback', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if ARGV[3] == 'scheduled' then
  redis.call('ZADD', KEYS[2], tonumber(ARGV[4]), ARGV[1])
elseif ARGV[3] == 'dead' then
  redis.call('ZADD', KEYS[3], tonumber(ARGV[4]), ARGV[1])
end
local keep = tonumber(ARGV[5])
if keep > 0 and redis.call('TTL', KEYS[1]) < keep then redis.call('EXPIRE', KEYS[1], keep) end
return 1
"""


class CallbackSender:
    """One delivery attempt of a job's callback, and what happens after it: delivered; retried later (the job id
    waits in the scheduled set, which the relays move back to the outbox when due: no Celery countdown, which
    the Redis transport would hand out again after its visibility timeout); or given up, the dead letter.

    Each attempt is recorded as `delivering` before the POST. The task is acknowledged only once it ran
    (acks_late): a worker that dies in the middle, even right after the receiver answered, has the task given
    back (tasks.liveness) and the callback is posted again, with the same X-Imgserve-Delivery-Id; the receiver
    drops the repeat (the receiver in docs/operations.md does, by job id and status). It never stays `pending`."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.service_settings = settings
        self.settings = settings.callbacks
        self.ttl_s = settings.jobs.ttl_s
        self.redis = client
        self.keys = Keys(settings.namespace)
        self.store = jobs.JobStore(client, self.keys, settings.jobs.ttl_s)
        self._record_state = client.register_script(_RECORD_STATE)

    def deliver(self, job_id: str) -> str:
        """One attempt: 'delivered', 'retrying', 'failed' (given up), or 'gone' (no job, no callback)."""
        record = self.store.load(job_id)
        if record is None or not record.get("callback_url"):
            return "gone"
        state = dict(record.get("callback") or {})
        if state.get("status") == "delivered":
            return "delivered before"   # a task given back after the delivery was recorded
        attempts = int(state.get("attempts", 0)) + 1
        first_at = float(state.get("first_at") or time.time())
        delivery_id = state.get("delivery_id") or f"{job_id}.{record.get('status')}"
        base = {"attempts": attempts, "first_at": first_at, "delivery_id": delivery_id}
        self._record(job_id, {**base, "status": "delivering", "last_error": state.get("last_error")})
        body = json.dumps(job_document(record), separators=(",", ":")).encode()
        timestamp = str(int(time.time()))
        try:
            secret = callback_secret(self.service_settings, record.get("owner"))
            if not secret:
                raise CallbackRefused("no callback secret is configured for this job's API key")
            target = resolve_callback_url(record["callback_url"], self.settings.allow_hosts)
            self._post(target, job_id, body, timestamp, secret, delivery_id)
        except (CallbackRefused, DeliveryFailed, SettingsError) as exc:
            return self._failed(job_id, base, str(exc)[:300], retry=isinstance(exc, DeliveryFailed))
        self._record(job_id, {**base, "status": "delivered", "last_error": None})
        return "delivered"

    def _failed(self, job_id: str, base: dict[str, Any], error: str, retry: bool) -> str:
        now = time.time()
        attempts = int(base["attempts"])
        within = now - float(base["first_at"]) < self.settings.retry_for_s
        if retry and attempts < self.settings.max_attempts and within:
            wait = backoff_s(attempts, self.settings.backoff_base_s, self.settings.backoff_max_s,
                             self.settings.jitter, random.random())
            self._record(job_id, {**base, "status": "retrying", "last_error": error, "next_attempt_at": now + wait},
                         place="scheduled", score=now + wait, keep_s=int(wait) + self.ttl_s)
            return "retrying"
        self._record(job_id, {**base, "status": "failed", "last_error": error}, place="dead", score=now,
                     keep_s=self.ttl_s)
        return "failed"

    def _post(self, target: CallbackTarget, job_id: str, body: bytes, timestamp: str, secret: str,
              delivery_id: str) -> None:
        headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: timestamp, JOB_ID_HEADER: job_id,
                   DELIVERY_ID_HEADER: delivery_id, SIGNATURE_HEADER: sign(secret, timestamp, job_id, body)}
        status = post_to(target, body, headers, self.settings.timeout_s, self.settings.max_response_bytes)
        if not 200 <= status < 300:
            raise DeliveryFailed(f"receiver answered {status}")

    def _record(self, job_id: str, state: dict[str, Any], place: str = "", score: float = 0.0,
                keep_s: int = 0) -> None:
        """The delivery's state on the job and where the job id waits next, in one step."""
        self._record_state(keys=[self.keys.job(job_id), self.keys.callback_scheduled, self.keys.callback_dead],
                           args=[job_id, json.dumps(state), place, score, keep_s])


