"""A submission's callback host, looked up off the API's event loop, within a deadline, a bounded number per key.

glibc's resolver blocks its thread until the name server answers or its own timeouts and retries run out
(for as long as a server that never answers lets it). Before this, the submit-time check called it on the gevent
worker's one thread: `contract.callbacks` had bound `socket.getaddrinfo` as a default argument when the
gunicorn master imported it, before the worker patched sockets: a few such submissions of one key stalled every
request of the process.

Here each lookup runs in a native thread of this process's own pool (gevent's ThreadPool under the gevent
worker, a ThreadPoolExecutor otherwise), and the request waits for it cooperatively, at most
`callbacks.lookup_timeout_s`: past it the submission is a 400 saying the host did not resolve in time. A
thread left in a lookup that never ends stays counted against the key that asked for it until the resolver
gives up: a key has at most `callbacks.max_lookups_per_key` lookups in this process (a 429 for it past them,
not for anyone else), and the process at most `callbacks.lookup_threads` (a 503 past them). The resolver
itself is looked up at each call, never bound when a module is imported.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from app.problems import Problem
from contract.callbacks import CallbackRefused

Resolver = Callable[..., list[Any]]


def gevent_patched() -> bool:
    """Whether this process runs under gevent's monkey-patching (the API's gevent worker)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))


def original(module: str, name: str) -> Any:
    """The standard library's `module.name` as it is now, unpatched by gevent: what a native thread may block in."""
    if gevent_patched():
        from gevent.monkey import get_original

        return get_original(module, name)
    return getattr(importlib.import_module(module), name)


def native_getaddrinfo() -> Resolver:
    """The blocking resolver, looked up now (a test's or gevent's patch of `socket.getaddrinfo` is seen)."""
    return original("socket", "getaddrinfo")  # type: ignore[no-any-return]


class CallbackLookups:
    """Callback host lookups for one API process (see the module's note)."""

    def __init__(self, timeout_s: float, per_key: int, threads: int) -> None:
        self.timeout_s, self.per_key, self.threads = timeout_s, per_key, threads
        self._lock = original("_thread", "allocate_lock")()  # a native lock: pool threads release under it too
        self._in_flight: dict[str, int] = {}
        self._pool: Any = None
        self._pool_pid = 0

    def in_flight(self, key: str | None = None) -> int:
        """Lookups not yet ended (a thread still in the resolver counts, whether or not its request gave up)."""
        with self._lock:
            return sum(self._in_flight.values()) if key is None else self._in_flight.get(key, 0)

    def resolver(self, key: str) -> Resolver:
        """A `resolve` for contract.callbacks.resolve_callback_url, on `key`'s account."""

        def resolve(host: str, port: int, **kwargs: Any) -> list[Any]:
            self._take(key)
            try:
                pending = self._submit(self._lookup, key, host, port, kwargs)
            except BaseException:
                self._give_back(key)
                raise
            return self._wait(pending, host)

        return resolve

    def _take(self, key: str) -> None:
        with self._lock:
            mine, total = self._in_flight.get(key, 0), sum(self._in_flight.values())
            if mine < self.per_key and total < self.threads:
                self._in_flight[key] = mine + 1
                return
        retry = {"Retry-After": str(max(1, math.ceil(self.timeout_s)))}
        if mine >= self.per_key:
            raise Problem(
                429,
                "callback-lookups-over-limit",
                "Too many callback lookups",
                f"{mine} lookups of your callback_url hosts are still waiting for their name server (at most "
                f"{self.per_key} at once): retry later, or use a host that resolves promptly",
                headers=retry,
            )
        raise Problem(
            503,
            "callback-lookups-busy",
            "Service unavailable",
            "this API process is looking up as many callback hosts as it may at once; retry",
            headers=retry,
        )

    def _give_back(self, key: str) -> None:
        with self._lock:
            left = self._in_flight.get(key, 0) - 1
            if left > 0:
                self._in_flight[key] = left
            else:
                self._in_flight.pop(key, None)

    def _lookup(self, key: str, host: str, port: int, kwargs: dict[str, Any]) -> list[Any]:
        """In a pool thread: the blocking lookup, its slot given back when it ends however late."""
        try:
            return list(native_getaddrinfo()(host, port, **kwargs))
        finally:
            self._give_back(key)

    def _submit(self, function: Callable[..., list[Any]], *args: Any) -> Any:
        pool = self._pool_here()
        return pool.spawn(function, *args) if gevent_patched() else pool.submit(function, *args)

    def _pool_here(self) -> Any:
        """This process's pool (made at first use, again after a fork: a pool's threads do not survive one)."""
        if self._pool is None or self._pool_pid != os.getpid():
            if gevent_patched():
                from gevent.threadpool import ThreadPool

                self._pool = ThreadPool(self.threads)
            else:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="callback-lookup")
            self._pool_pid = os.getpid()
        return self._pool

    def _wait(self, pending: Any, host: str) -> list[Any]:
        """The lookup's answer, waited for without holding the loop (gevent) or in the request's own thread."""
        if gevent_patched():
            from gevent import Timeout

            try:
                return list(pending.get(timeout=self.timeout_s))
            except Timeout:
                self._timed_out(host)
        try:
            return list(pending.result(timeout=self.timeout_s))
        except TimeoutError:
            self._timed_out(host)

    def _timed_out(self, host: str) -> NoReturn:
        public = f"its host did not resolve within {self.timeout_s:g} s (its name server did not answer in time)"
        raise CallbackRefused(f"callback host {host!r} did not resolve within {self.timeout_s:g} s", public)
