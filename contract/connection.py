"""Opening Redis the same way in every process."""
from __future__ import annotations

import redis

from contract.settings import Settings


def connect(settings: Settings, socket_timeout: float | None = None) -> redis.Redis:
    """A client returning bytes (frames are binary); timeouts bound every call."""
    return redis.Redis.from_url(
        settings.redis_url,
        socket_connect_timeout=settings.api.redis_timeout_s,
        socket_timeout=socket_timeout,
        health_check_interval=30,
        retry_on_timeout=False,
    )
