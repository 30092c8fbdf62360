"""Run a Procfile's processes together, their output straight to ours: what `make run` runs.

    python -m tools.procfile [Procfile] [--kill-wait-s 10]

Like honcho (which `make run` used before): each line `name: command` runs
under `/bin/sh -c` in its own session, with this environment and `.env`'s
variables over it; when one process ends, or on SIGINT/SIGTERM, every other
process group gets SIGTERM, and SIGKILL after `--kill-wait-s`; the exit status
is the first process's to end (130/143 after SIGINT/SIGTERM).

Unlike honcho, nothing relays the output: the processes write to this
process's stdout and stderr themselves. Honcho read every line through a pipe,
passed it through a multiprocessing queue and printed it again with a prefix:
about 1 ms of CPU per image at three log lines a job. The service's lines are
JSON carrying their `role` already, which the prefix only repeated.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

POLL_S = 0.2
_PROCESS_LINE = re.compile(r"^([A-Za-z0-9_-]+):\s*(.+)$")
_ENV_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_SIGNAL_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


def parse_procfile(text: str) -> dict[str, str]:
    """{name: command}, in the file's order; a name given twice is refused."""
    processes: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _PROCESS_LINE.match(line)
        if match is None:
            raise ValueError(f"Procfile line {number} is not `name: command`: {line!r}")
        name, command = match.groups()
        if name in processes:
            raise ValueError(f"Procfile names {name!r} twice")
        processes[name] = command
    return processes


def parse_env(text: str) -> dict[str, str]:
    """`.env` as honcho and compose read it: KEY=value lines, `#` comments, an optional `export`, a
    value in matching single quotes taken as is, in double quotes with \\n, \\" and \\\\ unescaped."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        match = _ENV_LINE.match(line.strip())
        if match is None:
            continue
        key, value = match.group(1), match.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        elif len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r'\\([n"\\])', lambda m: "\n" if m.group(1) == "n" else m.group(1), value[1:-1])
        values[key] = value
    return values


class Supervisor:
    """The processes of one Procfile, started together and stopped together."""

    def __init__(self, processes: dict[str, str], env: dict[str, str], kill_wait_s: float = 10.0) -> None:
        if not processes:
            raise ValueError("the Procfile names no process")
        self.commands = processes
        self.env = env
        self.kill_wait_s = kill_wait_s
        self.shells: dict[str, subprocess.Popen] = {}
        self.live: set[str] = set()       # whose process group may still hold a process
        self.status: int | None = None
        self.stopping_since: float | None = None
        self.killed = False

    def say(self, message: str) -> None:
        print(f"procfile: {message}", file=sys.stderr, flush=True)

    def run(self) -> int:
        """Until every process of every group has ended: a shell killed by SIGTERM ends at once, while
        the process it started (gunicorn, a Celery worker finishing its tasks) is still shutting down,
        and what it needs (Redis) must not be stopped under it."""
        for sig in _SIGNAL_STATUS:
            signal.signal(sig, self._on_signal)
        for name, command in self.commands.items():
            self.shells[name] = subprocess.Popen(["/bin/sh", "-c", command], env=self.env, start_new_session=True)
            self.live.add(name)
            self.say(f"{name} started (pid {self.shells[name].pid})")
        while self.live:
            for name in sorted(self.live):
                returncode = self.shells[name].poll()
                if returncode is None:
                    continue
                if self.status is None:
                    self.status = returncode
                self.stop()
                if not _group_alive(self.shells[name].pid):
                    self.live.discard(name)
                    self.say(f"{name} stopped (status {returncode})")
            if (self.stopping_since is not None and not self.killed
                    and time.monotonic() - self.stopping_since > self.kill_wait_s):
                self.killed = True
                self._signal_all(signal.SIGKILL)
            time.sleep(POLL_S)
        return self.status or 0

    def stop(self) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            self._signal_all(signal.SIGTERM)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.say(f"{signal.Signals(signum).name} received")
        if self.status is None:
            self.status = _SIGNAL_STATUS[signal.Signals(signum)]
        self.stop()

    def _signal_all(self, sig: signal.Signals) -> None:
        for name in sorted(self.live):
            pid = self.shells[name].pid
            try:
                os.killpg(pid, sig)   # the whole group: gunicorn's and Celery's own children too
            except ProcessLookupError:
                pass
            else:
                self.say(f"sent {sig.name} to {name} (pid {pid})")


def _group_alive(pgid: int) -> bool:
    """Whether any process of this group lives (a zombie does not count: it has ended, only its parent
    has not read its status yet)."""
    try:
        entries = os.listdir("/proc")
    except OSError:   # no /proc: ask the kernel, zombies included
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, _parent, group = stat.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.procfile", description=__doc__.splitlines()[0])
    parser.add_argument("procfile", nargs="?", type=Path, default=Path("Procfile"))
    parser.add_argument("--kill-wait-s", type=float, default=10.0,
                        help="how long the processes have to end after SIGTERM before SIGKILL")
    args = parser.parse_args(argv)
    procfile: Path = args.procfile
    env = dict(os.environ)
    dotenv = procfile.parent / ".env"
    if dotenv.is_file():
        env.update(parse_env(dotenv.read_text()))   # as honcho did: .env over the environment
    return Supervisor(parse_procfile(procfile.read_text()), env, args.kill_wait_s).run()


if __name__ == "__main__":
    sys.exit(main())
