"""Run a Procfile's processes together, their output straight to ours: what `make run` runs.

    python -m tools.procfile [Procfile] [--kill-wait-s 10] [--startup-s 15] [--no-restart]
                             [--ready-url URL [--ready-message TEXT]] [--own-terminal]

Each line `name: command` runs under `/bin/sh -c` in its own session, with this
environment and `.env`'s variables under it (a variable set in the environment
wins, as compose reads `.env`: `FLOWER_PORT=5556 make run` is not undone by a
copied `.env`). A process that ends once the
service is up is restarted, as compose's `restart: unless-stopped` does: its
whole process group is stopped first (gunicorn's or Celery's children would
still hold a port or a task), then it starts again after a backoff that doubles
from 1 s to 30 s and resets once it has stayed up a minute; every death and
restart is said on stderr. A process that ends in the first `--startup-s`
seconds stops everything instead (a broken config fails at once, not in a
loop), unless `--ready-url` answered 200 before: once the service said it is
ready, a process that dies is restarted whatever its age. The first 200 from
`--ready-url` also prints `--ready-message`, or the environment's
PROCFILE_READY_MESSAGE (make run's "ready at" line, which names Flower's
password: not on a command line, and not passed on to the processes).
SIGINT/SIGTERM stop every process with SIGTERM (each process's whole session: a
child that moved to a process group of its own goes too), and SIGKILL after
`--kill-wait-s`, naming what was still running; whatever a SIGKILL has not ended
`--kill-wait-s` later (a process stuck in the kernel) is named and left, so a
stop always ends. The exit status is then 0 when every process ended within it
(a clean stop), 130/143 when one had to be killed; else the first process's to
end. `--no-restart` keeps honcho's rule: the first process to end stops them
all. `--own-terminal` (make run's): Ctrl-C reaches this supervisor alone
(tools.terminal), so `make` ends with the supervisor's status.

Unlike honcho, nothing relays the output: the processes write to this
process's stdout and stderr themselves. Honcho read every line through a pipe,
passed it through a multiprocessing queue and printed it again with a prefix,
CPU spent on every log line. The service's lines are
JSON carrying their `role` already, which the prefix only repeated.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from tools.terminal import Foreground

POLL_S = 0.2
_PROCESS_LINE = re.compile(r"^([A-Za-z0-9_-]+):\s*(.+)$")
_ENV_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_SIGNAL_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
READY_MESSAGE_ENV = "PROCFILE_READY_MESSAGE"


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


BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STAYED_UP_S = 60.0  # a process up this long starts its next backoff from BACKOFF_START_S again
READY_POLL_S = 0.5


def answers_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):  # 503 (HTTPError), refused, timed out
        return False


class Supervisor:
    """The processes of one Procfile, started together, kept up, and stopped together."""

    def __init__(
        self,
        processes: dict[str, str],
        env: dict[str, str],
        kill_wait_s: float = 10.0,
        startup_s: float = 15.0,
        restart: bool = True,
        ready_url: str | None = None,
        ready_message: str = "",
    ) -> None:
        if not processes:
            raise ValueError("the Procfile names no process")
        self.commands = processes
        self.env = env
        self.kill_wait_s = kill_wait_s
        self.startup_s = startup_s
        self.restart = restart
        self.shells: dict[str, subprocess.Popen] = {}
        self.live: set[str] = set()  # whose process group may still hold a process
        self.started_at: dict[str, float] = {}
        self.backoff_s: dict[str, float] = {}
        self.restart_at: dict[str, float] = {}  # ended, its group gone: starts again then
        self.ending: dict[str, float] = {}  # ended; its group was sent SIGTERM at this time
        self.status: int | None = None
        self.began = time.monotonic()
        self.stopping_since: float | None = None
        self.killed = False
        self.killed_at = 0.0
        self.ready_url = ready_url
        self.ready_message = ready_message
        self.ready = threading.Event()  # the service answered ready_url once: the start-up window is over
        self.received: list[int] = []  # signals noted by the handler, acted on by the loop
        self.signalled: int | None = None  # the first SIGINT/SIGTERM: a stop asked for
        self.own_terminal = False
        self.foreground = Foreground()

    def say(self, message: str) -> None:
        print(f"procfile: {message}", file=sys.stderr, flush=True)

    def run(self) -> int:
        """Until every process of every group has ended: a shell killed by SIGTERM ends at once, while
        the process it started (gunicorn, a Celery worker finishing its tasks) is still shutting down,
        and what it needs (Redis) must not be stopped under it."""
        for sig in _SIGNAL_STATUS:
            signal.signal(sig, self._on_signal)
        if self.own_terminal and self.foreground.take():
            signal.signal(signal.SIGTSTP, self._on_signal)  # make, not stopped with it, would wait on it forever
        try:
            return self._supervise()
        except BaseException:
            # Whatever stopped this loop, its processes live in sessions of their own and would outlive it (and
            # the Redis `make run` stops after it): they go with it.
            self._stop_all_now()
            raise
        finally:
            self.foreground.give_back()

    def _supervise(self) -> int:
        for name in self.commands:
            self._start(name)
        if self.ready_url:
            threading.Thread(target=self._watch_readiness, name="readiness", daemon=True).start()
        while self.live or (self.restart_at and self.stopping_since is None):
            if self.received:
                self._handle_signal(self.received.pop(0))
            now = time.monotonic()
            for name in sorted(self.live):
                returncode = self.shells[name].poll()
                if returncode is None:
                    continue
                if self.stopping_since is None and name not in self.ending:
                    self._ended(name, returncode, now)
                if not _session_alive(self.shells[name].pid):
                    self.live.discard(name)
                    if self.stopping_since is not None or not self.restart:
                        self.say(f"{name} stopped{self._how(name, returncode)}")
                elif name in self.ending and now - self.ending[name] > self.kill_wait_s:
                    self._signal(name, signal.SIGKILL)
                    self.ending[name] = float("inf")  # once
            for name, at in sorted(self.restart_at.items()):
                if self.stopping_since is None and name not in self.live and now >= at:
                    del self.restart_at[name]
                    self.ending.pop(name, None)
                    self._start(name, again=True)
            if self.stopping_since is not None and not self._escalate(now):
                break
            time.sleep(POLL_S)
        if self.status is None and self.signalled is not None:
            return _SIGNAL_STATUS[signal.Signals(self.signalled)] if self.killed else 0  # 0: a clean stop
        return self.status or 0

    def _escalate(self, now: float) -> bool:
        """SIGKILL to what still runs kill_wait_s after the stop's SIGTERM, saying what; False once even that has
        not ended it kill_wait_s later (a process stuck in the kernel): named, and left, so a stop always ends."""
        assert self.stopping_since is not None
        if not self.killed and now - self.stopping_since > self.kill_wait_s:
            self.killed, self.killed_at = True, now
            still = ", ".join(sorted(self.live))
            self.say(f"still running {self.kill_wait_s:g} s after SIGTERM: {still}; sending SIGKILL")
            self._signal_all(signal.SIGKILL)
        if self.killed and self.live and now - self.killed_at > self.kill_wait_s:
            left = {name: sorted(_session_members(self.shells[name].pid)) for name in sorted(self.live)}
            self.say(
                f"still running {self.kill_wait_s:g} s after SIGKILL (stuck in the kernel?), left as they are: "
                + "; ".join(f"{name} (pids {', '.join(map(str, pids))})" for name, pids in left.items())
            )
            return False
        return True

    def _start(self, name: str, again: bool = False) -> None:
        self.shells[name] = subprocess.Popen(
            ["/bin/sh", "-c", self.commands[name]], env=self.env, start_new_session=True
        )
        self.live.add(name)
        self.started_at[name] = time.monotonic()
        self.say(f"{name} {'restarted' if again else 'started'} (pid {self.shells[name].pid})")

    def _how(self, name: str, returncode: int) -> str:
        """How a process ended once everything is stopping: ending by the SIGTERM (or SIGINT) this supervisor sent
        it, or with 0, is a clean stop (make run's Ctrl-C said `stopped (status -15)` of every worker, which read as
        a failure); anything else keeps its status."""
        asked = self.signalled is not None or name in self.ending or self.stopping_since is not None
        if returncode == 0 or (asked and returncode in (-signal.SIGTERM, -signal.SIGINT) and not self.killed):
            return " cleanly"
        if returncode == -signal.SIGKILL and (self.killed or self.ending.get(name) == float("inf")):
            return f" (killed: still running {self.kill_wait_s:g} s after SIGTERM)"
        return f" (status {returncode})"

    def _watch_readiness(self) -> None:
        """Poll ready_url until it answers 200 once (or the supervisor stops): then say so."""
        assert self.ready_url is not None
        while self.stopping_since is None:
            if answers_ok(self.ready_url):
                self.ready.set()
                if self.stopping_since is None:  # the message as given: make run's own line
                    print(
                        self.ready_message or f"procfile: ready: {self.ready_url} answers", file=sys.stderr, flush=True
                    )
                return
            time.sleep(READY_POLL_S)

    def _ended(self, name: str, returncode: int, now: float) -> None:
        """A process ended on its own: restart it (its group stopped first), or stop everything."""
        starting = not self.ready.is_set() and now - self.began < self.startup_s
        if not self.restart or starting:
            why = "" if not self.restart else f" within {self.startup_s:g} s of the start"
            self.say(f"{name} ended (status {returncode}){why}: stopping everything")
            if self.status is None:
                self.status = returncode
            self.stop()
            return
        up_s = now - self.started_at[name]
        backoff = BACKOFF_START_S if up_s >= STAYED_UP_S else self.backoff_s.get(name, BACKOFF_START_S)
        self.backoff_s[name] = min(BACKOFF_MAX_S, backoff * 2)
        self.restart_at[name] = now + backoff
        self.ending[name] = now
        self.say(f"{name} ended (status {returncode}) after {up_s:.0f} s up; restarting in {backoff:g} s")
        self._signal(name, signal.SIGTERM)  # what is left of its group (a master's workers, a pool's children)

    def stop(self) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            self.restart_at.clear()
            self._signal_all(signal.SIGTERM)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        """Noted only: the loop acts on it within POLL_S. A handler that printed could interrupt a print of the
        loop's own (Python then raises "reentrant call" inside stderr's writer): that ended this supervisor
        on a Ctrl-C and left every process running."""
        self.received.append(signum)

    def _handle_signal(self, signum: int) -> None:
        if signum == signal.SIGTSTP:
            self.say("Ctrl-Z does not pause make run (the service would go on unseen); Ctrl-C stops it")
            return
        self.say(f"{signal.Signals(signum).name} received")
        if self.signalled is None:
            self.signalled = signum
        self.stop()

    def _stop_all_now(self) -> None:
        """SIGTERM to every process group, SIGKILL to what is left after kill_wait_s: the supervisor is ending."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.kill_wait_s
        while time.monotonic() < deadline and any(_session_alive(self.shells[name].pid) for name in self.live):
            time.sleep(POLL_S)
        self._signal_all(signal.SIGKILL)

    def _signal_all(self, sig: signal.Signals) -> None:
        for name in sorted(self.live):
            self._signal(name, sig)

    def _signal(self, name: str, sig: signal.Signals) -> None:
        pid = self.shells[name].pid
        sent = False
        try:
            os.killpg(pid, sig)  # the whole group: gunicorn's and Celery's own children too
            sent = True
        except ProcessLookupError:
            pass
        # A process of its session that made a group of its own (a shell's job control, a daemon's helper) is out
        # of reach of killpg, and would outlive the stop.
        for member in _session_members(pid):
            try:
                os.kill(member, sig)
                sent = True
            except ProcessLookupError:
                pass
        if sent:
            self.say(f"sent {sig.name} to {name} (pid {pid})")


def _session_members(sid: int) -> set[int]:
    """The live processes of this session (a zombie does not count: it has ended, only its parent has not read its
    status yet). The supervisor starts each process as the leader of a session of its own, so these are that
    process and everything it started that did not leave the session."""
    members = set()
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: the group is what can be found
        try:
            os.killpg(sid, 0)
        except ProcessLookupError:
            return set()
        return {sid}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, _parent, _group, session = stat.read().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session) == sid and state != "Z":
            members.add(int(entry))
    return members


def _session_alive(sid: int) -> bool:
    """Whether any process of this session lives."""
    return bool(_session_members(sid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.procfile", description=__doc__.splitlines()[0])
    parser.add_argument("procfile", nargs="?", type=Path, default=Path("Procfile"))
    parser.add_argument(
        "--kill-wait-s",
        type=float,
        default=10.0,
        help="how long the processes have to end after SIGTERM before SIGKILL",
    )
    parser.add_argument(
        "--startup-s",
        type=float,
        default=15.0,
        help="a process ending this soon after the start stops everything (not restarted)",
    )
    parser.add_argument(
        "--no-restart", action="store_true", help="honcho's rule: the first process to end stops all the others"
    )
    parser.add_argument(
        "--ready-url",
        help="the service is up once this answers 200: say so (--ready-message), "
        "and restart a process that dies from then on, whatever its age",
    )
    parser.add_argument(
        "--ready-message",
        default="",
        help="printed once --ready-url first answers 200 (default: the environment's PROCFILE_READY_MESSAGE)",
    )
    parser.add_argument(
        "--own-terminal",
        action="store_true",
        help="take the terminal's foreground while running: Ctrl-C reaches this supervisor alone",
    )
    args = parser.parse_args(argv)
    procfile: Path = args.procfile
    dotenv = procfile.parent / ".env"
    # As compose reads .env: under the environment, which wins.
    env = {**(parse_env(dotenv.read_text()) if dotenv.is_file() else {}), **os.environ}
    ready_message = args.ready_message or env.pop(READY_MESSAGE_ENV, "")
    env.pop(READY_MESSAGE_ENV, None)
    supervisor = Supervisor(
        parse_procfile(procfile.read_text()),
        env,
        args.kill_wait_s,
        args.startup_s,
        restart=not args.no_restart,
        ready_url=args.ready_url,
        ready_message=ready_message,
    )
    supervisor.own_terminal = args.own_terminal
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
