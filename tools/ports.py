"""Before `make run` starts anything: is every port it will bind free? One line for each that is not.

    python -m tools.ports NAME=HOST:PORT=VARIABLE ...

Each argument names a listener (`the API=0.0.0.0:8000=IMGSERVE_API__BIND`). A port that cannot be bound is
said in one line: the port, who holds it when /proc tells (the pid and its command), the variable that moves
it and a free port to move it to. Exit 1 when any is busy, before anything starts: otherwise a busy port is
found far up among the start-up banners, after the supervisor gives up.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Listener:
    name: str  # what listens there, in words: "the API", "Flower"
    host: str
    port: int
    variable: str  # what moves it

    @classmethod
    def parse(cls, argument: str) -> Listener:
        name, address, variable = argument.split("=")
        host, _, port = address.rpartition(":")
        return cls(name, host.strip("[]") or "0.0.0.0", int(port), variable)


def bind_error(host: str, port: int) -> OSError | None:
    """What binding host:port says, as the servers bind it (SO_REUSEADDR: a port in TIME_WAIT is free to them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen(1)
        except OSError as exc:
            return exc
    return None


def holder(port: int) -> str | None:
    """The process listening on this TCP port, as `pid N (command)`, when /proc tells (this user's, or root's
    view of all); None when it does not."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            descriptors = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                target = os.readlink(f"/proc/{entry}/fd/{descriptor}")
            except OSError:
                continue
            if target in wanted:
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                command = command.strip()
                return f"pid {entry} ({command[:80] + ('...' if len(command) > 80 else '')})"
    return None


def free_port() -> int:
    """A port free on 127.0.0.1 now, as the system gives one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_near(host: str, port: int, taken: set[int]) -> int | None:
    for candidate in range(port + 1, min(port + 100, 65536)):
        if candidate not in taken and bind_error(host, candidate) is None:
            return candidate
    return None


def moved(listener: Listener, port: int) -> str:
    """The variable's value that moves the listener to `port`."""
    if listener.variable == "IMGSERVE_API__BIND":
        return f"{listener.variable}={listener.host}:{port}"
    if listener.variable == "IMGSERVE_REDIS_URL":
        return f"REDIS=private (a Redis of its own on a free port), or {listener.variable}=redis://127.0.0.1:{port}/0"
    return f"{listener.variable}={port}"


def check(listeners: list[Listener]) -> list[str]:
    """One line for each listener whose port cannot be bound."""
    lines = []
    taken = {listener.port for listener in listeners}
    for i, listener in enumerate(listeners):
        twice = next((other for other in listeners[:i] if other.port == listener.port), None)
        if twice is not None:
            lines.append(
                f"port {listener.port} is named for both {twice.name} ({twice.variable}) and {listener.name} "
                f"({listener.variable}): move one"
            )
            continue
        error = bind_error(listener.host, listener.port)
        if error is None:
            continue
        where = f"port {listener.port} ({listener.name}, {listener.host}:{listener.port})"
        if error.errno == errno.EADDRINUSE:
            held = holder(listener.port)
            why = f"is in use by {held}" if held else "is in use (by a process this user cannot see)"
        else:
            why = f"cannot be bound: {error.strerror}"
        near = free_port_near(listener.host, listener.port, taken)
        taken.add(near or 0)
        move = f"move it with {moved(listener, near)} make run" if near else f"move it with {listener.variable}"
        lines.append(f"{where} {why}: stop that, or {move}")
    return lines


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    busy = check([Listener.parse(argument) for argument in arguments])
    for line in busy:
        print(f"make run: not starting: {line}", file=sys.stderr)
    return 1 if busy else 0


if __name__ == "__main__":
    sys.exit(main())
