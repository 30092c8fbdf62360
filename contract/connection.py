"""Opening Redis the same way in every process: the server of `redis_url`, or the primary the Sentinels of
`redis.sentinels` name (followed through failovers: a connection to a demoted primary, or one that broke,
asks them again), and the durable write a `202` waits for (`execute_replicated`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
import redis
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer
from redis.sentinel import Sentinel, SentinelConnectionPool

from contract.replication import DurableWrites
from contract.settings import Settings

# Values over this many bytes go to the socket as chunks of their own, uncopied: hiredis would copy a
# 0.8 MB upload into one buffer with the command around it.
_BUFFER_CUTOFF = 6000
# A command that carries a payload (SET/SETEX/LPUSH of an upload or a frame) has a few arguments; only those
# are looked through for a large value. A many-argument command (a Lua step's keys and fields) is packed by
# hiredis at once: looking at every argument in Python is what made redis-py's own packer slow.
_PAYLOAD_COMMAND_ARGS = 6
_REDIS_PY_PACKER = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)  # type: ignore[no-untyped-call]


class CommandPacker:
    """Packs commands as redis-py's own packer does, byte for byte, at a fraction of its CPU.

    redis-py packs with hiredis when it is installed, but encodes every argument in Python first and copies
    large values into the one buffer; its pure-Python packer sends large values uncopied but formats every
    argument in Python (a Lua step of 100 arguments: ~250 us of CPU, a third of an API request's Redis
    time). This one hands a command to hiredis's C packer as it is (floats formatted by repr first, as
    redis-py formats them) and keeps redis-py's packer, uncopied chunks and all, for the few-argument
    commands that carry a large value. Stateless: one instance serves every connection.
    """

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
    settings: Settings, socket_timeout: float | None = None, max_connections: int | None = None, url: str | None = None
) -> redis.Redis:
    """A client returning bytes (frames are binary); timeouts bound every call. With `max_connections`, at most
    that many connections, a caller waiting up to the connect timeout for a free one, in a pool that closes its
    idle connections (IdleClosing). `url`: another server than redis_url's (a bulk shard: always a plain
    server)."""
    options: dict[str, Any] = dict(
        socket_connect_timeout=settings.api.redis_timeout_s,
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
    pool = IdleClosingPool.from_url(
        url, max_connections=max_connections, timeout=settings.api.redis_timeout_s, **options
    )
    return redis.Redis(connection_pool=pool)


def close_idle_connections(client: redis.Redis, idle_s: float) -> int:
    """IdleClosing.close_idle for a client whose pool is one (0 otherwise)."""
    pool = client.connection_pool
    return pool.close_idle(idle_s) if isinstance(pool, IdleClosing) else 0


def sentinels_of(settings: Settings) -> Sentinel:
    """The Sentinels of `redis.sentinels`, asked in turn (one down is skipped), each bounded by the connect
    timeout. Also what a process asks which server is the primary now (contract.replication)."""
    timeout = settings.api.redis_timeout_s
    own: dict[str, Any] = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
    if settings.redis.sentinel_password:
        own["password"] = settings.redis.sentinel_password
    return Sentinel(settings.redis.sentinel_addresses(), sentinel_kwargs=own)


def durable_writes(settings: Settings) -> DurableWrites | None:
    """Behind Sentinel, what a promised write waits for (contract.replication), asking each Sentinel with a
    short timeout of its own (a Sentinel cut off must not hold a refresh for long); None without Sentinels."""
    if not settings.redis.sentinels:
        return None
    timeout = settings.redis.sentinel_timeout_ms / 1000.0
    clients = [
        redis.Redis(
            host=host,
            port=port,
            password=settings.redis.sentinel_password or None,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
        )
        for host, port in settings.redis.sentinel_addresses()
    ]
    return DurableWrites(
        clients,
        settings.redis.service,
        settings.redis.replicas_per_write,
        refresh_s=settings.redis.view_refresh_ms / 1000.0,
        stale_s=settings.redis.view_stale_ms / 1000.0,
    )


def _primary_of(settings: Settings, options: dict[str, Any], max_connections: int | None) -> redis.Redis:
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
    sentinels = sentinels_of(settings)
    if max_connections is None:
        client: redis.Redis = sentinels.master_for(settings.redis.service, **node)
    else:
        client = sentinels.master_for(
            settings.redis.service,
            connection_pool_class=BlockingSentinelConnectionPool,
            max_connections=max_connections,
            timeout=settings.api.redis_timeout_s,
            **node,
        )
    return client


class NotReplicated(redis.RedisError):
    """A write that fewer replicas than asked acknowledged in time (WAIT): it may be lost in a failover."""

    def __init__(self, acknowledged: int, wanted: int) -> None:
        super().__init__(f"{acknowledged} of {wanted} replica(s) acknowledged the write in time")
        self.acknowledged, self.wanted = acknowledged, wanted


class AnswerNotReplicated(NotReplicated):
    """How a job ended is on fewer replicas than a 202 waits for: a read must not show it yet (a failover now
    could take it back). The reader asks again."""


def execute_and_wait(
    client: redis.Redis,
    commands: Sequence[tuple[Any, ...]],
    replicas: int,
    timeout_ms: int,
    check_primary: Callable[[tuple[str, int]], None] | None = None,
    then: Sequence[tuple[Any, ...]] = (),
) -> tuple[list[Any], int]:
    """`commands`, then, on the same connection, WAIT for `replicas` replicas, at most `timeout_ms`, then `then`:
    (the replies of `commands` and `then`, raw, without response callbacks; how many replicas acknowledged).
    WAIT counts the replicas that
    acknowledged everything this connection wrote, so it must follow the writes on their own connection:
    redis-py's pipeline hands its connection back before anything can follow it, and a WAIT inside MULTI
    returns at once. A reply that is an error (or holds one: EXEC's) is raised as ResponseError.
    `check_primary(address)`: raises before anything is sent when the connection's server is not the one to
    write to (contract.replication: a primary the Sentinels' majority no longer names); the connection and the
    pool's idle ones are dropped, so that the next ask the Sentinels again."""
    pool = client.connection_pool
    connection: Any = pool.get_connection()  # redis-py's Connection methods are untyped; connected already
    try:
        if check_primary is not None:
            try:
                check_primary((connection.host, connection.port))
            except redis.ConnectionError:
                pool.disconnect(inuse_connections=False)  # the idle ones are on the same server: all ask again
                raise
        connection.send_packed_command(connection.pack_commands([*commands, ("WAIT", replicas, timeout_ms), *then]))
        replies = [connection.read_response() for _ in range(len(commands) + 1 + len(then))]
    except BaseException:
        connection.disconnect()  # a reply half read would be the next user's
        raise
    finally:
        pool.release(connection)
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
        if isinstance(reply, list):
            for item in reply:  # EXEC's replies, one per queued command
                if isinstance(item, redis.ResponseError):
                    raise item
    waited = len(commands)
    return replies[:waited] + replies[waited + 1 :], int(replies[waited])
