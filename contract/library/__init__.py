"""The job's life in one Redis function library, `imgserve`: its `.lua` files here, its loader and its one recovery.

The library is one source: FILES, in order (a file's local functions serve the files after it; head.lua opens
it with the library's name and its version). Every process checks it at start (`ensure_library`): a Redis without
it, with an older version, or with this version's number but other code (a checkout between two versions: the
last process to start wins), gets this one by `FUNCTION LOAD REPLACE`; a newer one stays (a rolling upgrade's new
processes are the newer: docs/upgrading.md). Functions persist in Redis's RDB and AOF and replicate, so a restart
keeps them; a Redis that comes back empty (restarted without its data, a replica that never had them) answers
"Function not found", and `Step` loads the library there and calls once more: the only recovery, in one place.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

LIBRARY_NAME = "imgserve"
FILES = (
    "head.lua",
    "deadlines.lua",
    "budget.lua",
    "token_bucket.lua",
    "cache.lua",
    "ending.lua",
    "frames.lua",
    "write_batch.lua",
    "push.lua",
    "handoff.lua",
    "decode_share.lua",
    "admission.lua",
    "intake.lua",
    "hits.lua",
    "record.lua",
    "liveness.lua",
    "callback_slots.lua",
    "callbacks.lua",
    "cpu_hop.lua",
)
HERE = Path(__file__).parent
_VERSION = re.compile(r"^local VERSION = (\d+)$", re.MULTILINE)
_MISSING = "function not found"  # Redis's answer to an FCALL of a function no library registers


@functools.cache
def library_source() -> str:
    """The library as Redis loads it: FILES, in order, as one source."""
    return "\n".join((HERE / name).read_text() for name in FILES)


@functools.cache
def library_version() -> int:
    """This checkout's library version (head.lua's VERSION)."""
    found = _VERSION.search((HERE / FILES[0]).read_text())
    assert found, "head.lua carries `local VERSION = <n>`"
    return int(found.group(1))


def loaded_version(client: redis.Redis) -> int | None:
    """The version of the library `client`'s Redis has loaded; None when it has none."""
    try:
        return int(client.fcall_ro("imgserve_version", 0))  # type: ignore[no-untyped-call]
    except redis.ResponseError as error:
        if _MISSING in str(error).lower():
            return None
        raise


def ensure_library(client: redis.Redis) -> int:
    """Load this checkout's library unless the Redis has a newer one, or this very one, loaded already: the
    version it has now. Every process calls it at start (and `Step` when a function is missing). The same version
    with other code (a checkout between two versions) is replaced: the last process to start wins."""
    mine, loaded = library_version(), loaded_version(client)
    if loaded is not None and (loaded > mine or (loaded == mine and loaded_code(client) == library_source())):
        return loaded
    client.function_load(library_source(), replace=True)  # type: ignore[no-untyped-call]
    return mine


def loaded_code(client: redis.Redis) -> str | None:
    """The code of the library `client`'s Redis has loaded (FUNCTION LIST WITHCODE); None when it has none."""
    listed: Any = client.function_list(library=LIBRARY_NAME, withcode=True)  # type: ignore[no-untyped-call]
    for library in listed:
        fields = dict(zip(library[::2], library[1::2]))
        if fields.get(b"library_name") == LIBRARY_NAME.encode():
            return bytes(fields[b"library_code"]).decode()
    return None


def is_missing(reply: object) -> bool:
    """Whether a step's reply (from a pipeline, with raise_on_error=False) says the Redis had no such function."""
    return isinstance(reply, redis.ResponseError) and _MISSING in str(reply).lower()


class Step:
    """One function of the library, called by name. Its facade (the module of its step) builds its keys and
    arguments, at the positions its `.lua` file names."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, client: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """FCALL on `client`. A Redis that answers "Function not found" gets the library and the call once more.
        In a pipeline or MULTI the call is queued (its reply comes with the pipeline's: see `is_missing`)."""
        if isinstance(client, redis.client.Pipeline):
            return client.fcall(self.name, len(keys), *keys, *args)
        try:
            return client.fcall(self.name, len(keys), *keys, *args)
        except redis.ResponseError as error:
            if not is_missing(error):
                raise
            self.recover(client)
            return client.fcall(self.name, len(keys), *keys, *args)

    def recover(self, client: Any) -> None:
        """Load the library where this step was not found; a newer library without this step is an error."""
        loaded = ensure_library(client)
        if loaded != library_version():
            raise redis.ResponseError(f"the loaded {LIBRARY_NAME} library (version {loaded}) has no {self.name}")


def check_library_at_start(client: redis.Redis, log: logging.Logger) -> None:
    """A process's check at start (`ensure_library`); a Redis away now is left to the steps' recovery."""
    try:
        version = ensure_library(client)
    except redis.RedisError as exc:
        log.warning("the %s library is not checked (Redis: %s): the first step loads it", LIBRARY_NAME, exc)
        return
    log.info("the %s library: version %d loaded (this process's: %d)", LIBRARY_NAME, version, library_version())
