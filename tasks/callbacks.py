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
import http.client
import io
import ipaddress
import json
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import certifi
import redis

from contract.callbacks import (
    CallbackRefused,
    CallbackTarget,
    callback_secret,
    parse_callback_url,
    resolve_callback_url,
)
from contract.clock import now as service_now
from contract.documents import job_document
from contract.jobs.record import JobRecord, JobStore
from contract.keys import Keys
from contract.sections import SettingsError
from contract.settings import Settings
from tasks.callback_slots import TenantSlots

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Signature"
TIMESTAMP_HEADER = "X-Imgserve-Timestamp"
JOB_ID_HEADER = "X-Imgserve-Job-Id"
DELIVERY_ID_HEADER = "X-Imgserve-Delivery-Id"  # the same on every attempt of one job's callback
USER_AGENT = "imgserve-callbacks"


class DeliveryFailed(RuntimeError):
    """The receiver did not answer 2xx (or could not be reached, or not within the attempt's deadline)."""


class Deadline:
    """An attempt's end: each wait within it (connect, TLS, a write, a read) is given what is left, at most
    `step_s`. A per-read timeout alone let a receiver sending a byte every 2 s hold a thread for as long as it
    cared to (234 s, until it stopped)."""

    def __init__(self, seconds: float, step_s: float | None = None) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.step_s = seconds if step_s is None else step_s

    def left(self) -> float:
        """What is left for the next wait; TimeoutError once nothing is."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the attempt's deadline of {self.seconds:g} s passed")
        return min(left, self.step_s)


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes for http.client's response parser, each read bounded by the deadline: the status line,
    the headers (however slowly trickled) and the body all come within it, or the attempt ends."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.sock.settimeout(self.deadline.left())
        return self.sock.recv_into(buffer)


class _DeadlineSocket:
    """What http.client.HTTPResponse reads from: makefile() only."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self.sock, self.deadline = sock, deadline

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self.sock, self.deadline))


_tls_context: ssl.SSLContext | None = None
_tls_lock = threading.Lock()


def tls_context() -> ssl.SSLContext:
    """One verifying context per process (certifi's roots): loading them costs ~10 ms, and a context is shared
    safely between threads."""
    global _tls_context
    with _tls_lock:
        if _tls_context is None:
            _tls_context = ssl.create_default_context(cafile=certifi.where())
        return _tls_context


def post_to(
    target: CallbackTarget,
    body: bytes,
    headers: Mapping[str, str],
    timeout_s: float,
    max_response_bytes: int,
    deadline_s: float | None = None,
) -> int:
    """POST to the checked address itself; the URL's host goes in Host (and SNI and the certificate
    check for https). Returns the status; reads at most max_response_bytes of the answer.

    The whole attempt (connect, TLS handshake, the request, the answer's status line, headers and body) ends
    within `deadline_s` (default: timeout_s) whatever the receiver does, each wait in it at most `timeout_s`:
    DeliveryFailed otherwise. No redirect is followed, no proxy is used."""
    deadline = Deadline(timeout_s if deadline_s is None else deadline_s, timeout_s)
    return post_within(target, body, headers, deadline, max_response_bytes)


def post_within(
    target: CallbackTarget, body: bytes, headers: Mapping[str, str], deadline: Deadline, max_response_bytes: int
) -> int:
    url = target.url
    family = socket.AF_INET6 if ":" in target.address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(deadline.left())
        sock.connect((target.address, url.port))
        if url.scheme == "https":
            sock.settimeout(deadline.left())  # the handshake is one call: bounded by the timeout as it starts
            sock = tls_context().wrap_socket(sock, server_hostname=url.host)
        lines = [
            f"POST {url.target} HTTP/1.1",
            f"Host: {url.host_header}",
            f"User-Agent: {USER_AGENT}",
            "Accept-Encoding: identity",
            "Connection: close",
            f"Content-Length: {len(body)}",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        _send_all(sock, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body, deadline)
        response = http.client.HTTPResponse(_DeadlineSocket(sock, deadline), method="POST")  # type: ignore[arg-type]
        response.begin()
        response.read(max_response_bytes)
        return response.status
    except TimeoutError as exc:
        raise DeliveryFailed(f"the receiver did not answer within {deadline.seconds:g} s ({exc})") from exc
    except ssl.SSLError as exc:
        raise DeliveryFailed(f"TLS with the receiver failed: {exc.reason or type(exc).__name__}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise DeliveryFailed(f"cannot reach the receiver: {type(exc).__name__}: {exc}"[:200]) from exc
    finally:
        sock.close()


def _send_all(sock: socket.socket, data: bytes, deadline: Deadline) -> None:
    """sendall, each send bounded by what is left (an SSL socket's sendall gives each of its sends the whole
    timeout: a receiver reading slowly would stretch it)."""
    view = memoryview(data)
    while view:
        sock.settimeout(deadline.left())
        view = view[sock.send(view) :]


def bounded_resolver(deadline: Deadline) -> Callable[..., list[Any]]:
    """getaddrinfo within the deadline. The lookup cannot be interrupted, so it runs in a helper thread that is
    left to the resolver's own timeout when the deadline passes (an attacker's name server that never answers
    would otherwise hold the callback thread for the resolver's timeouts and retries)."""

    def resolve(host: str, port: int, **kwargs: Any) -> list[Any]:
        try:
            ipaddress.ip_address(host)
            return socket.getaddrinfo(host, port, **kwargs)  # a literal address: no lookup, nothing to wait for
        except ValueError:
            pass
        outcome: dict[str, Any] = {}

        def lookup() -> None:
            try:
                outcome["infos"] = socket.getaddrinfo(host, port, **kwargs)
            except Exception as exc:
                outcome["error"] = exc

        helper = threading.Thread(target=lookup, name="callback-lookup", daemon=True)
        helper.start()
        helper.join(max(0.0, deadline.at - time.monotonic()))
        if helper.is_alive():
            raise DeliveryFailed(f"the receiver's host did not resolve within {deadline.seconds:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return list(outcome["infos"])

    return resolve


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
    drops the repeat (the receiver in docs/operations.md does, by job id and status). It never stays `pending`.

    An attempt holds its thread for `callbacks.deadline_s` at most, whatever the receiver does (Celery's time
    limits are not enforced by the threads pool: the attempt bounds itself), and only once it has one of its
    tenant's slots (tasks.callback_slots): a tenant's slow receivers hold that many threads, never all of them."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.service_settings = settings
        self.settings = settings.callbacks
        self.ttl_s = settings.jobs.ttl_s
        self.redis = client
        self.keys = Keys(settings.namespace)
        self.store = JobStore(client, self.keys, settings.jobs.ttl_s)
        self.slots = TenantSlots(client, self.keys, settings.callbacks.max_per_tenant, settings.callbacks.deadline_s)
        self._record_state = client.register_script(_RECORD_STATE)

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
            return self._failed(job_id, base, exc.public[:300], retry=False)
        except (DeliveryFailed, SettingsError) as exc:
            return self._failed(job_id, base, str(exc)[:300], retry=isinstance(exc, DeliveryFailed))
        # delivered_at: a redelivery request moments later answers with this one (contract.jobs.ending)
        self._record(job_id, {**base, "status": "delivered", "last_error": None, "delivered_at": service_now()})
        return "delivered"

    def _failed(self, job_id: str, base: dict[str, Any], error: str, retry: bool) -> str:
        now = service_now()
        attempts = int(base["attempts"])
        within = now - float(base["first_at"]) < self.settings.retry_for_s
        if retry and attempts < self.settings.max_attempts and within:
            wait = backoff_s(
                attempts,
                self.settings.backoff_base_s,
                self.settings.backoff_max_s,
                self.settings.jitter,
                random.random(),
            )
            self._record(
                job_id,
                {**base, "status": "retrying", "last_error": error, "next_attempt_at": now + wait},
                place="scheduled",
                score=now + wait,
                keep_s=int(wait) + self.ttl_s,
            )
            return "retrying"
        self._record(
            job_id, {**base, "status": "failed", "last_error": error}, place="dead", score=now, keep_s=self.ttl_s
        )
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
        headers = {
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: timestamp,
            JOB_ID_HEADER: job_id,
            DELIVERY_ID_HEADER: delivery_id,
            SIGNATURE_HEADER: sign(secret, timestamp, job_id, body),
        }
        status = post_within(target, body, headers, deadline, self.settings.max_response_bytes)
        if not 200 <= status < 300:
            raise DeliveryFailed(f"receiver answered {status}")

    def _record(self, job_id: str, state: dict[str, Any], place: str = "", score: float = 0.0, keep_s: int = 0) -> None:
        """The delivery's state on the job and where the job id waits next, in one step."""
        self._record_state(
            keys=[self.keys.job(job_id), self.keys.callback_scheduled, self.keys.callback_dead],
            args=[job_id, json.dumps(state), place, score, keep_s],
        )


def tenant_of(record: Mapping[str, Any]) -> str:
    """Whose slots a job's callback takes: its API key's; without one, its receiving host's."""
    if record.get("owner"):
        return f"key:{record['owner']}"
    try:
        return "host:" + parse_callback_url(record["callback_url"]).host
    except CallbackRefused:
        return "host:"  # refused at its attempt anyway
