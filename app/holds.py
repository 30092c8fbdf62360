"""What one client may hold in an API process at once: requests in flight, long-polls, and body bytes.

A long-poll costs a greenlet and a connection for up to `api.max_wait_s`, a body being read its bytes for up
to `body_timeout_s` plus its size at `body_min_rate`. Unbounded per client, one key's long-polls could fill every
connection (and /healthz wait in the listen backlog), and a few trickled bodies could hold most of the API's memory
(docs/benchmarks/2026-12-06-hostile-round-five.md). So, in each API process:

- a client (its API key; without keys there are no tenants, and only the process's own bounds hold) has at
  most `api.max_requests_per_client` requests in flight and `max_waits_per_client` long-polls held: past
  either, 429 at once, before the body is read, its connection closed;
- long-polls held by all clients together are at most `max_waits` (0: half the pool of connections or
  threads), so that half the pool is always free for everything else (/healthz and /readyz are never behind
  a wait): past it, 503;
- bodies count against `max_body_bytes` (every client's) and `max_body_bytes_per_client` from their first
  byte, their Content-Length reserved before a byte is read (a chunked body's bytes as they come), and held
  until the request ends: past the client's budget 429, past the process's 503.

Counters in memory (one process: no Redis round trip, nothing to leak when a process dies); locked where requests
run on threads. Each refusal says `Retry-After` and `Connection: close` (app.server closes it).
"""

from __future__ import annotations

import heapq
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from flask import Flask, g

from app.problems import Problem
from contract.settings import ApiSettings

# Retry-After of a refusal for requests or bodies in flight: they end within seconds (a long-poll's refusal says
# when the first of the waits in its way ends instead: WaitEnds).
RETRY_AFTER_S = 2
CLOSE = {"Connection": "close"}  # app.server's worker closes a connection whose answer says so


def _lock_for_this_process() -> AbstractContextManager[Any]:
    """A lock where requests run on threads; none under gevent's monkey-patching (the gevent worker): its
    requests are greenlets of one thread that switch only on I/O, and nothing here does any (a patched lock
    would add its own cost to every submission and poll for nothing)."""
    try:
        from gevent.monkey import is_module_patched
    except ImportError:
        return threading.Lock()
    return nullcontext() if is_module_patched("threading") else threading.Lock()


def pool_size(api: ApiSettings) -> int:
    """Requests one API process serves at once: its gevent connections, or its gthread threads."""
    return api.threads if api.worker_class == "gthread" else api.connections


class WaitEnds:
    """The long-polls one client (or every client) holds: when each will end at the latest, and the soonest."""

    def __init__(self) -> None:
        self.ends: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []  # (end, token), tokens of ended waits dropped lazily

    def __len__(self) -> int:
        return len(self.ends)

    def add(self, token: int, end: float) -> None:
        self.ends[token] = end
        heapq.heappush(self._heap, (end, token))

    def drop(self, token: int) -> bool:
        """Forget a wait that ended; True when none is left."""
        self.ends.pop(token, None)
        return not self.ends

    def first_end_in(self) -> int:
        """Whole seconds until the soonest of these waits ends (at least 1), spread over up to as long again:
        clients refused together (thousands of one key's) come back over a span, not all in the same second."""
        while self._heap and self._heap[0][1] not in self.ends:
            heapq.heappop(self._heap)
        soonest = self._heap[0][0] if self._heap else time.monotonic()
        seconds = max(1, math.ceil(soonest - time.monotonic()))
        return seconds + random.randint(0, seconds)


@dataclass
class Holds:
    """One API process's counters (see the module's note)."""

    max_requests_per_client: int
    max_waits_per_client: int
    max_waits: int
    max_body_bytes: int
    max_body_bytes_per_client: int
    requests: Counter[str] = field(default_factory=Counter)
    waits: dict[str, WaitEnds] = field(default_factory=dict)  # long-polls held, by client ("" for all)
    bodies: Counter[str] = field(default_factory=Counter)  # bytes held, by client ("" for all)
    _lock: AbstractContextManager[Any] = field(default_factory=lambda: _lock_for_this_process())
    _tokens: int = 0

    @classmethod
    def of(cls, api: ApiSettings) -> Holds:
        half = max(1, pool_size(api) // 2)
        return cls(
            max_requests_per_client=min(api.max_requests_per_client, half),
            max_waits_per_client=min(api.max_waits_per_client, half),
            max_waits=min(api.max_waits or half, half),
            max_body_bytes=api.max_body_bytes,
            max_body_bytes_per_client=api.max_body_bytes_per_client,
        )

    def enter(self, client: str) -> None:
        """A request of `client`'s begins (leave() when it ends); 429 past its requests in flight."""
        with self._lock:
            if self.requests[client] >= self.max_requests_per_client:
                raise _too_many(
                    f"your key has {self.requests[client]} requests in flight in this API process "
                    f"(api.max_requests_per_client: {self.max_requests_per_client}); retry when one ends"
                )
            self.requests[client] += 1

    def leave(self, client: str) -> None:
        with self._lock:
            _decrement(self.requests, client, 1)

    @contextmanager
    def wait(self, client: str, seconds: float) -> Iterator[None]:
        """A long-poll of up to `seconds` held for its length: 429 past the client's bound, 503 past the
        process's; Retry-After says when the first of the waits in the way ends (an attacker that honours it
        comes back when there is room, not every second)."""
        with self._lock:
            refused, every = self._waits_refusal(client), self.waits.get("")
            if refused is not None:
                raise refused
            if every is not None and len(every) >= self.max_waits:
                raise _unavailable(
                    f"this API process holds {len(every)} long-polls, its most (api.max_waits): "
                    "retry, or read without wait",
                    every.first_end_in(),
                )
            self._tokens += 1
            token, end = self._tokens, time.monotonic() + seconds
            for key in ("", client) if client else ("",):
                self.waits.setdefault(key, WaitEnds()).add(token, end)
        try:
            yield
        finally:
            with self._lock:
                for key in ("", client) if client else ("",):
                    if self.waits[key].drop(token):
                        del self.waits[key]  # no entry kept per client that holds nothing

    def waits_refusal(self, client: str) -> Problem | None:
        """The 429 a long-poll of `client`'s gets while its long-polls are at their bound, or None; read without
        taking a place (app.early_refusal asks before Flask is called, `wait` when it holds one)."""
        with self._lock:
            return self._waits_refusal(client)

    def _waits_refusal(self, client: str) -> Problem | None:
        mine = self.waits.get(client) if client else None
        if mine is None or len(mine) < self.max_waits_per_client:
            return None
        return _too_many(
            f"your key holds {len(mine)} long-polls in this API process (api.max_waits_per_client: "
            f"{self.max_waits_per_client}); poll again when one ends, or without wait",
            mine.first_end_in(),
        )

    def take_body(self, client: str, size: int) -> None:
        """`size` more bytes of a body held (give_back_body when the request ends); a Problem past a budget."""
        if size <= 0:
            return
        with self._lock:
            if client and self.bodies[client] + size > self.max_body_bytes_per_client:
                raise _too_many(
                    f"your key's bodies in flight in this API process would hold {self.bodies[client] + size} "
                    f"bytes (api.max_body_bytes_per_client: {self.max_body_bytes_per_client}); retry when one ends"
                )
            if self.bodies[""] + size > self.max_body_bytes:
                raise _unavailable(
                    f"bodies in flight in this API process would hold {self.bodies[''] + size} bytes "
                    f"(api.max_body_bytes: {self.max_body_bytes}); retry"
                )
            self.bodies[""] += size
            if client:
                self.bodies[client] += size

    def give_back_body(self, client: str, size: int) -> None:
        if size <= 0:
            return
        with self._lock:
            _decrement(self.bodies, "", size)
            if client:
                _decrement(self.bodies, client, size)


def install(app: Flask, holds: Holds, keyed: bool) -> None:
    """Count each request of an API key's (after app.auth's hook: registered after it) until it ends, however it
    ends. Without keys (`keyed` False) there are no clients to count: no hooks, nothing paid per request."""
    if not keyed:
        return

    @app.before_request
    def hold_request() -> None:
        client = g.get("client_id")
        if client:
            holds.enter(client)
            g.held_by = client

    @app.teardown_request
    def release_request(_exc: BaseException | None) -> None:
        client = g.pop("held_by", None)
        if client:
            holds.leave(client)


class BodyHold:
    """A submission's share of the body budget: what it took, given back whole when it leaves the `with`."""

    def __init__(self, holds: Holds, client: str) -> None:
        self.holds, self.client, self.size = holds, client, 0

    def take(self, size: int) -> None:
        self.holds.take_body(self.client, size)
        self.size += max(0, size)

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.holds.give_back_body(self.client, self.size)
        self.size = 0


def _decrement(counter: Counter[str], key: str, by: int) -> None:
    left = counter[key] - by
    if left > 0:
        counter[key] = left
    else:
        del counter[key]  # no entry kept per client that holds nothing


def _too_many(detail: str, retry_after_s: int = RETRY_AFTER_S) -> Problem:
    return Problem(
        429, "too-many-held", "Too many requests", detail, headers={"Retry-After": str(retry_after_s), **CLOSE}
    )


def _unavailable(detail: str, retry_after_s: int = RETRY_AFTER_S) -> Problem:
    return Problem(
        503, "server-busy", "Service unavailable", detail, headers={"Retry-After": str(retry_after_s), **CLOSE}
    )
