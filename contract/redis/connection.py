"""Opening Redis the same way in every process: the server of `redis_url`, or the primary the Sentinels of
`redis.sentinels` name (followed through failovers: a connection to a demoted primary, or one that broke,
asks them again). What a `202` waits for once the write is made is contract.redis.replication's."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import hiredis
import redis
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer
from redis.sentinel import Sentinel, SentinelConnectionPool

from contract.settings.redis_settings import RedisSettings

# Values over this many bytes go to the socket as chunks of their own, uncopied: hiredis would copy a
# 0.8 MB upload into one buffer with the command around it.
_BUFFER_CUTOFF = 6000
# A command that carries a payload (SET/SETEX/LPUSH of an upload or a frame) has a few arguments; only those
# are looked through for a large value. A many-argument command (a Lua step's keys and fields) is packed by
# hiredis at once: looking at every argument in Python is what made redis-py's own packer slow.
_PAYLOAD_COMMAND_ARGS = 6
_REDIS_PY_PACKER = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)  # type: ignore[no-untyped-call]


class RedisReach(Protocol):
    """What opening the control plane's Redis reads of the settings: its URL and the `redis` section (contract.settings'
    Settings is one)."""

    @property
    def redis_url(self) -> str: ...

    @property
    def redis(self) -> RedisSettings: ...


class CommandPacker:
    """Packs commands as redis-py's own packer does, byte for byte, at a fraction of its CPU.

    redis-py packs with hiredis when it is installed, but encodes every argument in Python first and copies
    large values into the one buffer; its pure-Python packer sends large values uncopied but formats every
    argument in Python, a large share of an API request's Redis time for a Lua step of many arguments
    (docs/benchmarks/2026-12-04-framework-floors.md). This one hands a command to hiredis's C packer as it is (floats
    formatted by repr first, as redis-py formats them) and keeps redis-py's packer, uncopied chunks and all, for the
    few-argument commands that carry a large value. Stateless: one instance serves every connection."""

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if len(args) <= _PAYLOAD_COMMAND_ARGS:
            for value in args:
                if isinstance(value, (bytes, memoryview)) and len(value) > _BUFFER_CUTOFF:
                    return _REDIS_PY_PACKER.pack(*args)  # type: ignore[no-any-return,no-untyped-call]
        command = args[0]
        if (isinstance(command, str) and " " in command) or (isinstance(command, bytes) and b" " in command):
            args = (*command.split(), *args[1:])  # "SCRIPT LOAD": Redis wants the words apart
        packable: Any = tuple(repr(value) if type(value) is float else value for value in args)
        try:
            return [hiredis.pack_command(packable)]
        except TypeError as exc:  # None, a bool, a bytearray: what redis-py's encoder refuses too
            raise redis.DataError(f"Invalid input in command {command!r}: {exc}") from None


COMMAND_PACKER = CommandPacker()


class IdleClosing:
    """A bounded pool (redis.BlockingConnectionPool) whose connections left idle are closed by `close_idle`.

    redis-py's pools keep every connection they ever opened: an API process under a burst opened one per
    greenlet in a Redis round trip at once and held them, and their descriptors (and Redis's client buffers),
    for the rest of its life. The pool is a stack (the last released is taken first), so under a steady load
    the connections beyond what it needs sit idle at the bottom: those are the ones closed. A closed
    connection keeps its place in the pool and connects again if a later command needs it."""

    pool: Any  # BlockingConnectionPool's LifoQueue of connections

    def __init__(self, *args: Any, clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        self.clock = clock
        super().__init__(*args, **kwargs)

    def release(self, connection: Any) -> None:
        connection.imgserve_released_at = self.clock()  # on the connection itself: nothing to prune
        super().release(connection)  # type: ignore[misc]  # the pool class this is mixed into

    def close_idle(self, idle_s: float) -> int:
        """Disconnect the connections that have waited in the pool longer than `idle_s`; how many it closed."""
        cutoff = self.clock() - idle_s
        closed = 0
        # Under the queue's own lock no caller can take a connection while it is being closed.
        with self.pool.mutex:
            for connection in self.pool.queue:
                if (
                    connection is not None
                    and getattr(connection, "_sock", None) is not None
                    and getattr(connection, "imgserve_released_at", cutoff) < cutoff
                ):
                    connection.disconnect()
                    closed += 1
        return closed


class IdleClosingPool(IdleClosing, redis.BlockingConnectionPool):
    """A plain server's bounded pool that closes its idle connections."""


class BlockingSentinelConnectionPool(IdleClosing, SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool (connections to whichever server is the primary now) with BlockingConnectionPool's bound:
    at most `max_connections`, a caller waiting `timeout` for a free one; idle connections closed as above."""


def connect(
    settings: RedisReach,
    socket_timeout: float | None = None,
    max_connections: int | None = None,
    url: str | None = None,
) -> redis.Redis:
    """A client returning bytes (frames are binary); timeouts bound every call. With `max_connections`, at most
    that many connections, a caller waiting up to the connect timeout for a free one, in a pool that closes its
    idle connections (IdleClosing). `url`: another server than redis_url's (a bulk shard: always a plain
    server)."""
    options: dict[str, Any] = dict(
        socket_connect_timeout=settings.redis.timeout_s,
        socket_timeout=socket_timeout,
        health_check_interval=30,
        retry_on_timeout=False,
        command_packer=COMMAND_PACKER,
    )
    if url is None and settings.redis.sentinels:
        return _primary_of(settings, options, max_connections)
    url = url or settings.redis_url
    if max_connections is None:
        return redis.Redis.from_url(url, **options)
    pool = IdleClosingPool.from_url(url, max_connections=max_connections, timeout=settings.redis.timeout_s, **options)
    return redis.Redis(connection_pool=pool)


def close_idle_connections(client: redis.Redis, idle_s: float) -> int:
    """IdleClosing.close_idle for a client whose pool is one (0 otherwise)."""
    pool = client.connection_pool
    return pool.close_idle(idle_s) if isinstance(pool, IdleClosing) else 0


def sentinels_of(section: RedisSettings) -> Sentinel:
    """The Sentinels of `redis.sentinels`, asked in turn (one down is skipped), each bounded by the connect
    timeout. Also what a process asks which server is the primary now (contract.redis.replication)."""
    timeout = section.timeout_s
    own: dict[str, Any] = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
    if section.sentinel_password:
        own["password"] = section.sentinel_password
    return Sentinel(section.sentinel_addresses(), sentinel_kwargs=own)


def _primary_of(settings: RedisReach, options: dict[str, Any], max_connections: int | None) -> redis.Redis:
    """A client of the primary the Sentinels name for `redis.service`: each new connection asks them where it is,
    and a connection that finds a demoted primary (READONLY) breaks, so the next asks again."""
    parts = urlsplit(settings.redis_url)
    node = {**options, "db": int(parts.path.lstrip("/") or 0)}
    if parts.password:
        node["password"] = unquote(parts.password)
    if parts.username:
        node["username"] = unquote(parts.username)
    if parts.scheme == "rediss":
        node["ssl"] = True
    sentinels = sentinels_of(settings.redis)
    if max_connections is None:
        client: redis.Redis = sentinels.master_for(settings.redis.service, **node)
    else:
        client = sentinels.master_for(
            settings.redis.service,
            connection_pool_class=BlockingSentinelConnectionPool,
            max_connections=max_connections,
            timeout=settings.redis.timeout_s,
            **node,
        )
    return client
