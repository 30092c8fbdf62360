"""Opening Redis the same way in every process."""
from __future__ import annotations

from typing import Any

import hiredis
import redis
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

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
            args = (*command.split(), *args[1:])   # "SCRIPT LOAD": Redis wants the words apart
        packable: Any = tuple(repr(value) if type(value) is float else value for value in args)
        try:
            return [hiredis.pack_command(packable)]
        except TypeError as exc:   # None, a bool, a bytearray: what redis-py's encoder refuses too
            raise redis.DataError(f"Invalid input in command {command!r}: {exc}") from None


COMMAND_PACKER = CommandPacker()


def connect(settings: Settings, socket_timeout: float | None = None, max_connections: int | None = None,
            url: str | None = None) -> redis.Redis:
    """A client returning bytes (frames are binary); timeouts bound every call. With `max_connections`, at most
    that many connections, a caller waiting up to the connect timeout for a free one. `url`: another server
    than redis_url's (a bulk shard)."""
    url = url or settings.redis_url
    options: dict[str, Any] = dict(socket_connect_timeout=settings.api.redis_timeout_s, socket_timeout=socket_timeout,
                                   health_check_interval=30, retry_on_timeout=False, command_packer=COMMAND_PACKER)
    if max_connections is None:
        return redis.Redis.from_url(url, **options)
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                 timeout=settings.api.redis_timeout_s, **options)
    return redis.Redis(connection_pool=pool)
