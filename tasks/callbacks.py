"""Signed callbacks: POST the finished job's document to the client's URL.

Safety: only http(s); targets on loopback, private, link-local (cloud metadata
included), multicast or reserved addresses are refused unless `allow_hosts`
admits them, checked at submit and again after DNS resolution at delivery.
Bounded timeouts and response size; no redirects.

Signature: `X-Signature: sha256=<hex HMAC-SHA256(secret, timestamp + "." + body)>`
with `X-Imgserve-Timestamp: <unix seconds>`: receivers recompute it and refuse
stale timestamps (replays). See README for a ten-line receiver.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import socket
import time
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

import redis
import requests

from contract import jobs
from contract.documents import job_document
from contract.keys import Keys
from contract.settings import Settings

SIGNATURE_HEADER = "X-Signature"
TIMESTAMP_HEADER = "X-Imgserve-Timestamp"


class CallbackRefused(ValueError):
    """A callback URL the service will not call."""


class DeliveryFailed(RuntimeError):
    """The receiver did not answer 2xx (or could not be reached)."""


def sign(secret: str, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def check_callback_url(url: str, allow_hosts: Iterable[str] = (),
                       resolve: Callable[..., list] = socket.getaddrinfo) -> None:
    try:
        parts = urlsplit(url)
        port = parts.port   # a malformed URL or port raises here
    except ValueError as exc:
        raise CallbackRefused(f"callback_url is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CallbackRefused("callback_url must be an http(s) URL with a host")
    host, allowed = parts.hostname, list(allow_hosts)
    if host in allowed:
        return
    networks = [ipaddress.ip_network(a, strict=False) for a in allowed if _is_network(a)]
    try:
        infos = resolve(host, port or (443 if parts.scheme == "https" else 80), proto=socket.IPPROTO_TCP)
    except (OSError, ValueError) as exc:   # IDNA refuses some names with a UnicodeError
        raise CallbackRefused(f"callback host {host!r} does not resolve: {exc}") from exc
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if any(address in network for network in networks):
            continue
        if not address.is_global or address.is_multicast or address.is_reserved:
            raise CallbackRefused(f"callback host {host!r} resolves to {address}, a loopback, private, "
                                  f"link-local or reserved address (allow it with callbacks.allow_hosts)")


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
        return True
    except ValueError:
        return False


class CallbackSender:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings.callbacks
        self.redis = client
        self.keys = Keys(settings.namespace)
        self.store = jobs.JobStore(client, self.keys, settings.jobs.ttl_s)
        self.session = requests.Session()

    def deliver(self, job_id: str, attempt: int) -> str:
        """One attempt; raises DeliveryFailed for the task to retry."""
        record = self.store.load(job_id)
        if record is None or not record.get("callback_url"):
            return "gone"
        body = json.dumps(job_document(record), separators=(",", ":")).encode()
        timestamp = str(int(time.time()))
        try:
            check_callback_url(record["callback_url"], self.settings.allow_hosts)
            self._post(record["callback_url"], body, timestamp)
        except (CallbackRefused, DeliveryFailed, requests.RequestException) as exc:
            final = attempt + 1 >= self.settings.max_attempts or isinstance(exc, CallbackRefused)
            self._record(job_id, "failed" if final else "retrying", attempt + 1, str(exc)[:300])
            if final:
                return "failed"
            raise DeliveryFailed(str(exc)) from exc
        self._record(job_id, "delivered", attempt + 1, None)
        return "delivered"

    def _post(self, url: str, body: bytes, timestamp: str) -> None:
        headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: timestamp,
                   SIGNATURE_HEADER: sign(self.settings.secret, timestamp, body)}
        with self.session.post(url, data=body, headers=headers, timeout=self.settings.timeout_s,
                               allow_redirects=False, stream=True) as response:
            response.raw.read(self.settings.max_response_bytes, decode_content=True)
            if not 200 <= response.status_code < 300:
                raise DeliveryFailed(f"receiver answered {response.status_code}")

    def _record(self, job_id: str, status: str, attempts: int, error: str | None) -> None:
        state: dict[str, Any] = {"status": status, "attempts": attempts, "last_error": error}
        if self.redis.exists(self.keys.job(job_id)):
            self.redis.hset(self.keys.job(job_id), "callback", json.dumps(state))


def relay_outbox(client: redis.Redis, keys: Keys, send: Callable[[str], None], limit: int = 100) -> int:
    """Hand ended jobs' callbacks to Celery. LPOP is atomic: each entry goes to one relay, once."""
    sent = 0
    while sent < limit:
        job_id = client.lpop(keys.callback_outbox)
        if job_id is None:
            break
        send(job_id.decode())
        sent += 1
    return sent
