"""Replies that carry payloads (an upload, a frame), read straight from the socket into one buffer each.

redis-py's parser copies a reply three times (its socket buffer, hiredis's buffer, the bytes object)
and costs several times the CPU of reading it once (docs/benchmarks/2026-12-02-feeding-a-fast-gpu.md). So the commands
that return payloads go out on a dedicated redis-py connection (which keeps connecting, AUTH, SELECT and TLS as the
client is configured) and their replies are read here."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import redis

# A payload's first part comes with the line before it; larger reads only copy more of it twice.
_LINE_READ = 8192
# Errors that say this server is no primary (now): READONLY (a replica), LOADING (restarting), MASTERDOWN.
_NOT_THE_PRIMARY = ("READONLY", "LOADING", "MASTERDOWN")
Reply = Any  # memoryview | bytes | int | None | list[Reply] | redis.ResponseError


class PayloadReader:
    """Sends commands in one write and parses their replies (RESP2, and RESP3's nil): a bulk string of
    any size as a memoryview over its own buffer, arrays, integers, simple strings, and errors as
    `redis.ResponseError` values in the list (the connection stays in step). Any failure of the
    connection drops it (a half-read reply cannot be resumed), and so does a reply that says the server is
    no primary now; the next call takes a connection through the pool again."""

    def __init__(self, client: redis.Redis) -> None:
        self.pool = client.connection_pool
        self.connection: Any = None
        self.buffer = bytearray()

    def execute(self, *commands: Sequence[Any]) -> list[Reply]:
        if self.connection is None:
            self.connection = self.pool.get_connection()
        connection = self.connection
        try:
            connection.send_packed_command(connection.pack_commands(commands))
            replies = [self._reply(connection._sock) for _ in commands]
        except BaseException as exc:
            self._drop()
            if isinstance(exc, socket.timeout):
                raise redis.TimeoutError("timeout reading a reply") from exc
            if isinstance(exc, OSError):
                raise redis.ConnectionError(f"reading a reply: {exc}") from exc
            raise
        for reply in replies:
            if isinstance(reply, redis.ResponseError) and str(reply).startswith(_NOT_THE_PRIMARY):
                # A server that became a replica (a failover) or is loading (a restart): redis-py's own replies
                # turn this into a broken connection, and so does this one, so the next call finds the primary.
                self._drop()
                raise redis.ConnectionError(f"the server answered {str(reply)[:80]!r}: connecting again")
        return replies

    def _drop(self) -> None:
        """Close the connection and give it back to the pool: the next call takes one through the pool, which
        connects as the client is configured (with Sentinels: to the primary they name now). Reusing this one
        would reconnect to the address it had: redis-py reconnects a closed connection there directly."""
        connection, self.connection = self.connection, None
        self.buffer.clear()
        if connection is not None:
            connection.disconnect()
            self.pool.release(connection)

    def bulks(self, *commands: Sequence[Any]) -> list[memoryview | None]:
        """For commands that each answer one bulk string or nil (an error is raised)."""
        replies = self.execute(*commands)
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
            if reply is not None and not isinstance(reply, memoryview):
                raise redis.ConnectionError(f"expected a bulk reply, got {type(reply).__name__}")
        return replies

    def _reply(self, sock: socket.socket) -> Reply:
        line = self._line(sock)
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            return self._bulk(sock, int(rest))
        if kind in (b"*", b"~", b"%"):  # array; RESP3's set, and its map as the flat list RESP2 gives
            count = int(rest) * (2 if kind == b"%" else 1)
            return None if count < 0 else [self._small(self._reply(sock)) for _ in range(count)]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return bytes(rest)
        if kind == b"-":
            return redis.ResponseError(rest.decode(errors="replace"))
        if line == b"_":
            return None
        if kind == b"#":
            return rest == b"t"
        raise redis.ConnectionError(f"unexpected reply {line[:32]!r}")

    @staticmethod
    def _small(item: Reply) -> Reply:
        """An array's strings (a record's fields) as bytes, as redis-py gives them."""
        return bytes(item) if isinstance(item, memoryview) else item

    def _bulk(self, sock: socket.socket, length: int) -> memoryview | None:
        if length < 0:
            return None
        data = bytearray(length + 2)
        view = memoryview(data)
        have = min(len(self.buffer), len(data))
        view[:have] = self.buffer[:have]
        del self.buffer[:have]
        while have < len(data):
            got = sock.recv_into(view[have:])
            if not got:
                raise redis.ConnectionError("the connection closed in the middle of a reply")
            have += got
        if data[length:] != b"\r\n":
            raise redis.ConnectionError("a reply did not end where its length said")
        return view[:length]

    def _line(self, sock: socket.socket) -> bytes:
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 2]
                return line
            chunk = sock.recv(_LINE_READ)
            if not chunk:
                raise redis.ConnectionError("the connection closed before a reply")
            self.buffer += chunk
