"""Opening Redis the same way in every process."""
from __future__ import annotations

from typing import Any

import redis
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

from contract.settings import Settings

# redis-py packs a command with hiredis when hiredis is installed, and hiredis copies every argument
# into one buffer: 1.3 ms of CPU for a 0.8 MB upload (the API's SET, the CPU worker's frame push).
# redis-py's own packer sends a value over 6,000 bytes as its own chunk, uncopied (3 us). Replies are
# still parsed by hiredis. Stateless, so one instance serves every connection.
_BUFFER_CUTOFF = 6000
_UNCOPIED_VALUES = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)  # type: ignore[no-untyped-call]


def connect(settings: Settings, socket_timeout: float | None = None, max_connections: int | None = None,
            url: str | None = None) -> redis.Redis:
    """A client returning bytes (frames are binary); timeouts bound every call. With `max_connections`, at most
    that many connections, a caller waiting up to the connect timeout for a free one. `url`: another server
    than redis_url's (a bulk shard)."""
    url = url or settings.redis_url
    options: dict[str, Any] = dict(socket_connect_timeout=settings.api.redis_timeout_s, socket_timeout=socket_timeout,
                                   health_check_interval=30, retry_on_timeout=False, command_packer=_UNCOPIED_VALUES)
    if max_connections is None:
        return redis.Redis.from_url(url, **options)
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                 timeout=settings.api.redis_timeout_s, **options)
    return redis.Redis(connection_pool=pool)
