"""Counts this Python process's Redis round trips, by server port, where `bench plane` can read them at any moment.

A round trip is one `send_packed_command` of redis-py's connection: one command, or one pipeline or MULTI block sent
whole, each answered before the caller goes on (kombu's BRPOP, a PING of a health check and a connection's HELLO
too). A subscriber's pushed messages are not round trips and are not counted.

Started by IMGSERVE_ROUND_TRIPS_DIR (a folder) with this folder first on PYTHONPATH; IMGSERVE_ROUND_TRIPS_ROLE names
the process (api, cpu-worker, gpu-worker). Each process (a forked child its own) keeps one 8-byte counter a port in a
file `<role>.<port>.<pid>`, mapped into memory: an increment is a store, and a reader sees it at once, with no flush
to wait for. Self-contained (it imports nothing of the bench): `bench plane --base` runs an older checkout's
processes with this checkout's hook. redis is patched as it is first imported, not imported here, so that gevent's
monkey-patching still comes first in the API."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import mmap
import os
import struct
import sys
import threading
from types import ModuleType
from typing import Any

_FOLDER = os.environ.get("IMGSERVE_ROUND_TRIPS_DIR", "")
_ROLE = os.environ.get("IMGSERVE_ROUND_TRIPS_ROLE", "python")


class _Counters:
    """This process's counters, a port each, in files the bench reads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.maps: dict[int, tuple[mmap.mmap, list[int]]] = {}

    def forget(self) -> None:
        """In a forked child: its parent's files are its parent's; it counts in files of its own."""
        self.lock = threading.Lock()
        self.maps = {}

    def count(self, port: int) -> None:
        with self.lock:
            entry = self.maps.get(port)
            if entry is None:
                path = os.path.join(_FOLDER, f"{_ROLE}.{port}.{os.getpid()}")
                with open(path, "w+b") as file:
                    file.write(b"\0" * 8)
                    file.flush()
                    entry = (mmap.mmap(file.fileno(), 8), [0])
                self.maps[port] = entry
            memory, total = entry
            total[0] += 1
            struct.pack_into("<q", memory, 0, total[0])


_COUNTERS = _Counters()


def _patch(connection_module: ModuleType) -> None:
    connection_class: Any = connection_module.AbstractConnection
    send = connection_class.send_packed_command

    def counted_send(self: Any, command: Any, check_health: bool = True) -> Any:
        _COUNTERS.count(int(getattr(self, "port", 0) or 0))
        return send(self, command, check_health)

    connection_class.send_packed_command = counted_send


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of redis.connection so the module is patched once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "redis.connection":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            run_module(module)
            _patch(module)

        loader.exec_module = exec_then_patch
        return spec


if _FOLDER:
    os.register_at_fork(after_in_child=_COUNTERS.forget)
    sys.meta_path.insert(0, _PatchOnImport())
