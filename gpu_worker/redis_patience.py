"""How the GPU worker waits out a Redis that does not answer: each call retried with backoff, until stopping."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import redis

log = logging.getLogger("gpu_worker")
T = TypeVar("T")


class UntilRedisAnswers:
    """`until_redis_answers(action)`: `action()`, retried with backoff while Redis is unreachable."""

    def __init__(self, stopping: threading.Event) -> None:
        self.stopping = stopping
        # Gave up on Redis while stopping: no later write may happen (acks go by count, in order), and the
        # worker does not leave the registry, so its frames are reaped once its heartbeat expires.
        self.abandoned = False

    def __call__(self, action: Callable[[], T]) -> T:
        """Once the worker is stopping it gives up at the next failure (the RedisError propagates, and every
        later call fails at once): told to stop while Redis is away, it must still stop. What it holds stays
        in its processing list, given back at its next start or by another worker's reaper."""
        delay = 0.2
        while True:
            if self.abandoned:
                raise redis.ConnectionError("this worker gave up on Redis while stopping")
            try:
                return action()
            except redis.RedisError as exc:
                if self.stopping.is_set():
                    self.abandoned = True
                    log.error(
                        "redis unavailable (%s) while stopping: giving up; the frames in hand stay in "
                        "this worker's processing list",
                        exc,
                    )
                    raise
                log.warning("redis unavailable (%s); retrying in %.1f s", exc, delay)
                self.stopping.wait(delay)  # SIGTERM cuts the wait short
                delay = min(delay * 2, 5.0)
