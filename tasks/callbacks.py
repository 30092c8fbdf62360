"""Signed callbacks: POST the finished job's document to the client's URL.

Safety. The URL is parsed strictly, by this module's own grammar, not by a
library that might read it differently from the one that connects: only
`http(s)://host[:port][/path][?query]` in printable ASCII, with no userinfo
(`user@`), no backslash, no fragment, and an IP address only in its canonical
form (dotted decimal, or bracketed IPv6; decimal, octal and hex forms of an
address are refused). The host is resolved once; every address it resolves to
must be public (not loopback, private, link-local or cloud metadata, shared,
multicast, reserved, nor an IPv6 form embedding one of those) unless
`callbacks.allow_hosts` admits it; then the connection goes to that checked
address, never to a second lookup (no DNS rebinding), with the URL's host in
the Host header and, for https, in SNI and the certificate check. Checked at
submit and again at each delivery. Bounded timeouts and response size; no
redirects; no proxies from the environment.

Signature: `X-Signature: sha256=<hex HMAC-SHA256(secret, timestamp + "." + job id
+ "." + body)>`, with `X-Imgserve-Timestamp: <unix seconds>` and
`X-Imgserve-Job-Id`. The secret is the job's API key's own
(`auth.api_keys[].callback_secret_env` or `_file`), or `callbacks.secret` when
the deployment has no keys. See the README for a receiver that refuses stale
and replayed deliveries.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import certifi
import redis
import urllib3

from contract import jobs
from contract.documents import job_document
from contract.keys import Keys
from contract.settings import Settings, SettingsError, check_secret

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Signature"
TIMESTAMP_HEADER = "X-Imgserve-Timestamp"
JOB_ID_HEADER = "X-Imgserve-Job-Id"
DELIVERY_ID_HEADER = "X-Imgserve-Delivery-Id"   # the same on every attempt of one job's callback

_URL = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::(?P<port>[0-9]{1,5}))?"
    r"(?P<path>/[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*)?(?P<query>\?[A-Za-z0-9\-._~!$&'()*+,;=:@/%?]*)?")
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_NUMBER = re.compile(r"(0[xX][0-9A-Fa-f]*|[0-9]+)")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class CallbackRefused(ValueError):
    """A callback URL the service will not call."""


class DeliveryFailed(RuntimeError):
    """The receiver did not answer 2xx (or could not be reached)."""


@dataclass(frozen=True)
class CallbackUrl:
    scheme: str        # http | https
    host: str          # as written, lower case; an IPv6 address without its brackets
    port: int
    target: str        # path and query: what the request line asks for

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.scheme == "https" else 80) else f"{host}:{self.port}"


@dataclass(frozen=True)
class CallbackTarget:
    url: CallbackUrl
    address: str       # the address that passed the check: the one the delivery connects to


def parse_callback_url(url: str) -> CallbackUrl:
    """The URL by this module's grammar (see the module's note), or CallbackRefused."""
    if not isinstance(url, str) or not url.isascii() or not url.isprintable() or " " in url:
        raise CallbackRefused("callback_url must be printable ASCII without spaces (IDN hosts in their xn-- form)")
    if "\\" in url:
        raise CallbackRefused("callback_url must not contain a backslash")
    authority = url.partition("://")[2].partition("/")[0].partition("?")[0]
    if "@" in authority:
        raise CallbackRefused("callback_url must not carry credentials (user@host)")
    match = _URL.fullmatch(url)
    if match is None:
        raise CallbackRefused("callback_url must be http(s)://host[:port][/path][?query], with no user@ and no #")
    scheme = match["scheme"].lower()
    if scheme not in ("http", "https"):
        raise CallbackRefused("callback_url must be an http or https URL")
    host = _checked_host(match["host"])
    port = int(match["port"]) if match["port"] else (443 if scheme == "https" else 80)
    if not 1 <= port <= 65535:
        raise CallbackRefused(f"callback_url's port {port} is out of range")
    target = (match["path"] or "/") + (match["query"] or "")
    return CallbackUrl(scheme, host, port, target)


def _checked_host(host: str) -> str:
    if host.startswith("["):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError as exc:
            raise CallbackRefused(f"callback_url's host {host} is not an IPv6 address") from exc
    host = host.lower()
    labels = host.split(".")
    if all(_NUMBER.fullmatch(label) for label in labels):   # an address: only the canonical dotted form
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            address = None
        if address is None or str(address) != host:
            raise CallbackRefused(f"callback_url's host {host!r} is a number that is not a dotted-decimal "
                                  "IPv4 address (decimal, octal and hex forms are refused)")
        return host
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise CallbackRefused(f"callback_url's host {host!r} is not a valid DNS name")
    return host


def forbidden_reason(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why a callback must not reach this address, or None if it is a public one. IPv6 forms that
    carry an IPv4 address (mapped, 6to4, Teredo, NAT64) are judged by that address too."""
    candidates: list[Any] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        candidates += [v4 for v4 in (address.ipv4_mapped, address.sixtofour) if v4 is not None]
        candidates += list(address.teredo or ())
        if address in _NAT64:
            candidates.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    for candidate in candidates:
        if (not candidate.is_global or candidate.is_multicast or candidate.is_reserved
                or candidate.is_unspecified or candidate.is_loopback or candidate.is_link_local):
            return f"{address}, a loopback, private, link-local, shared or reserved address"
    return None


def resolve_callback_url(url: str, allow_hosts: Iterable[str] = (),
                         resolve: Callable[..., list] = socket.getaddrinfo) -> CallbackTarget:
    """Parse, resolve once, check every address; the target to connect to (CallbackRefused otherwise)."""
    parsed = parse_callback_url(url)
    entries = [allow_entry(entry) for entry in allow_hosts]
    at_port = [where for where, port in entries if port is None or port == parsed.port]
    allowed = [where for where in at_port if not _is_network(where)]
    networks = [ipaddress.ip_network(where, strict=False) for where in at_port if _is_network(where)]
    try:
        infos = resolve(parsed.host, parsed.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, ValueError) as exc:
        raise CallbackRefused(f"callback host {parsed.host!r} does not resolve: {exc}") from exc
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise CallbackRefused(f"callback host {parsed.host!r} resolves to no address")
    for address in addresses:
        if parsed.host in allowed or any(address in network for network in networks):
            continue
        reason = forbidden_reason(address)
        if reason:
            raise CallbackRefused(f"callback host {parsed.host!r} resolves to {reason} "
                                  "(allow it with callbacks.allow_hosts)")
    return CallbackTarget(parsed, str(addresses[0]))


def allow_entry(entry: str) -> tuple[str, int | None]:
    """A callbacks.allow_hosts entry as (host or network, port or None for any): `hooks.internal`,
    `10.0.0.0/8`, `127.0.0.1:8080`, `hooks.internal:443`, `[fd00::/8]:8443` (an IPv6 one with a port in
    brackets). A port admits that port only: an allowed loopback host is not every local service."""
    text = entry.strip().lower()
    try:
        if text.startswith("["):
            inner, _, rest = text[1:].partition("]")
            return inner, int(rest[1:]) if rest.startswith(":") else None
        if text.count(":") == 1:
            where, _, port = text.partition(":")
            return where, int(port)
    except ValueError as exc:
        raise SettingsError(f"callbacks.allow_hosts entry {entry!r}: its port is not a number") from exc
    return text, None


def check_callback_url(url: str, allow_hosts: Iterable[str] = (),
                       resolve: Callable[..., list] = socket.getaddrinfo) -> None:
    resolve_callback_url(url, allow_hosts, resolve)


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
        return True
    except ValueError:
        return False


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


def callback_secret(settings: Settings, owner: str | None) -> str | None:
    """The secret that signs this job's callbacks: its API key's own; the deployment's only when it
    has no keys. None: callbacks are not available to this client."""
    if not settings.auth.api_keys:
        return settings.callbacks.secret or None
    for entry in settings.auth.api_keys:
        if str(entry["id"]) == owner:
            return key_callback_secret(entry)
    return None


def key_callback_secret(entry: Mapping[str, Any]) -> str | None:
    """An API key's callback secret, from the environment variable or the file its entry names."""
    if entry.get("callback_secret_env"):
        secret = os.environ.get(str(entry["callback_secret_env"]), "")
    elif entry.get("callback_secret_file"):
        try:
            with open(str(entry["callback_secret_file"]), encoding="utf-8") as handle:
                secret = handle.read().strip()
        except OSError as exc:
            raise SettingsError(f"API key {entry['id']!r}: cannot read its callback secret: {exc}") from exc
    else:
        return None
    check_secret(f"API key {entry['id']!r}'s callback secret", secret)
    return secret


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
    drops the repeat (the README's receiver does, by job id and status). It never stays `pending`."""

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


# KEYS[1] outbox, KEYS[2] relaying (zset), KEYS[3] scheduled (zset); ARGV[1] now, ARGV[2] taken before this
# is stale. Retries that are due and entries a dead relay held go to the outbox first; then one entry moves
# from the outbox to `relaying`.
_TAKE_FROM_OUTBOX = """
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[1], 'LIMIT', 0, 100)
for _, job_id in ipairs(due) do
  redis.call('ZREM', KEYS[3], job_id)
  redis.call('RPUSH', KEYS[1], job_id)
end
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
for _, job_id in ipairs(stale) do
  redis.call('ZREM', KEYS[2], job_id)
  redis.call('RPUSH', KEYS[1], job_id)
end
local job_id = redis.call('LPOP', KEYS[1])
if job_id then
  redis.call('ZADD', KEYS[2], ARGV[1], job_id)
end
return job_id
"""
RELAY_STALE_AFTER_S = 60.0


def relay_outbox(client: redis.Redis, keys: Keys, send: Callable[[str], None], limit: int = 100) -> int:
    """Hand ended jobs' callbacks, and retries that are due, to Celery. Each entry moves to `relaying` in the
    step that takes it and leaves it only once Celery has the task: a failed send puts it back at the outbox's
    head, and one whose relay died is taken again after RELAY_STALE_AFTER_S. Nothing is lost."""
    take = client.register_script(_TAKE_FROM_OUTBOX)
    sent = 0
    while sent < limit:
        now = time.time()
        job_id = take(keys=[keys.callback_outbox, keys.callback_relaying, keys.callback_scheduled],
                      args=[now, now - RELAY_STALE_AFTER_S])
        if job_id is None:
            break
        try:
            send(job_id.decode())
        except Exception:
            pipe = client.pipeline(transaction=True)
            pipe.zrem(keys.callback_relaying, job_id)
            pipe.lpush(keys.callback_outbox, job_id)
            pipe.execute()
            raise
        client.zrem(keys.callback_relaying, job_id)
        sent += 1
    return sent


class OutboxRelay:
    """The callback worker's relay: a thread that wakes when a job with a callback ends (the outbox's
    channel; at least every second) and hands ended jobs' callbacks to Celery. One per callback worker;
    several may run at once."""

    def __init__(self, client: redis.Redis, keys: Keys, send: Callable[[str], None]) -> None:
        self.client, self.keys, self.send = client, keys, send
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.keys.callback_outbox)
                while not self._stopping.is_set():
                    pubsub.get_message(timeout=1.0)
                    relay_outbox(self.client, self.keys, self.send)
            except Exception:   # Redis or the broker away: try again in a second, nothing was lost
                log.warning("callback relay interrupted", exc_info=True)
                self._stopping.wait(1.0)
            finally:
                pubsub.close()
