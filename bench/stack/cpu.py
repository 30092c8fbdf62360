"""CPU time per image, per role: the figure the story says to watch.

The deployment's processes on this machine are found by their command lines
(every role of the Procfile, the compose file and the bench's own stacks
starts recognisably), children included (Celery's prefork children, gunicorn's
workers). Their user + system CPU time is read from /proc before and after a
run; the difference, divided by the requests that succeeded, is each role's
CPU milliseconds per image. Processes born during the run count from zero;
those that died during it are lost (their time is not in /proc any more).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

# (role, what its command line holds), first match wins.
ROLES = (
    ("api", ("gunicorn", "app:create_app")),
    ("cpu-worker", ("celery", "-Q preprocess")),
    ("cpu-worker", ("celery", "-Q,preprocess")),
    ("callback-worker", ("celery", "-Q callbacks")),
    ("flower", ("celery", "flower")),
    ("gpu-worker", ("-m gpu_worker",)),
    ("redis", ("redis-server",)),
    ("supervisor", ("-m tools.procfile",)),  # what make run runs the Procfile with
    ("supervisor", ("honcho",)),  # or a deployment's own honcho
    ("baseline", ("-m baseline",)),
)
ROLE_ORDER = (
    "api",
    "cpu-worker",
    "gpu-worker",
    "callback-worker",
    "flower",
    "redis",
    "redis-replica",
    "redis-sentinel",
    "supervisor",
    "baseline",
    "bench",
)
_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str] | None:
    """A /proc stat file's fields after the command name (which may hold spaces), from the state on; None when
    the process or thread is gone."""
    try:
        stat = Path(path).read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def thread_seconds(pid: int, tid: int) -> float | None:
    """One thread's user + system CPU seconds (Redis's main thread: what one Redis core must carry)."""
    fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICK


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (orders processes by age)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return None if fields is None else int(fields[19])


def read_process(pid: int) -> tuple[str, int, float, int] | None:
    """(command line, parent pid, CPU seconds, session id) of a live process, or None."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = _stat_fields(f"/proc/{pid}/stat")
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    if "redis-server" in cmdline:
        # + cutime + cstime: the children Redis forked and reaped (an append-only file's rewrite, a snapshot),
        # whose CPU is part of Redis's and shows nowhere else
        ticks += int(fields[13]) + int(fields[14])
    return cmdline, int(fields[1]), ticks / _TICK, int(fields[3])


def role_of(cmdline: str, redis_port: int | None = None) -> str | None:
    for role, needles in ROLES:
        if all(needle in cmdline for needle in needles):
            if role == "redis" and redis_port is not None and f":{redis_port}" not in cmdline:
                return None
            return role
    return None


@dataclass
class CpuSample:
    seconds: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (role, CPU seconds)
    redis_main: dict[int, float] = field(default_factory=dict)  # redis pid -> its main thread's


SHARD_ROLE = "redis-shard"  # + the shard's index: a bulk shard's redis-server (contract.redis.shards)


def sample(
    redis_port: int | None = None,
    bench_pid: int | None = None,
    sessions: set[int] | None = None,
    shard_ports: tuple[int, ...] = (),
    port_roles: tuple[tuple[int, str], ...] = (),
) -> CpuSample:
    """Every process of a role on this machine now: by its own command line, else its nearest
    ancestor's (prefork children, gunicorn workers); with `sessions`, only the processes in those
    sessions and their descendants (a bench stack's own), and its Redis. `port_roles`: more redis-servers,
    each (port, role) (a Sentinel set's replicas and Sentinels)."""
    processes = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (read := read_process(int(entry))) is not None:
            processes[int(entry)] = read

    def lineage(pid: int):
        while pid in processes:
            yield pid
            pid = processes[pid][1]

    roles: dict[int, str] = {}
    for pid in processes:
        shard = next(
            (
                i
                for i, port in enumerate(shard_ports)
                if "redis-server" in processes[pid][0] and processes[pid][0].rstrip().endswith(f":{port}")
            ),
            None,
        )
        if shard is not None:
            roles[pid] = f"{SHARD_ROLE}{shard}"
            continue
        named = next(
            (
                role
                for port, role in port_roles
                if "redis-server" in processes[pid][0] and re.search(rf":{port}\b", processes[pid][0])
            ),
            None,
        )
        if named is not None:
            roles[pid] = named
            continue
        chain = list(lineage(pid))
        role = next((r for p in chain if (r := role_of(processes[p][0], redis_port)) is not None), None)
        in_scope = sessions is None or role == "redis" or any(processes[p][3] in sessions for p in chain)
        if role is not None and in_scope:
            roles[pid] = role
    if bench_pid is not None and bench_pid in processes:
        roles[bench_pid] = "bench"
    taken = CpuSample({pid: (role, processes[pid][2]) for pid, role in roles.items()})
    for pid, role in roles.items():
        if role == "redis" and (main := thread_seconds(pid, pid)) is not None:
            taken.redis_main[pid] = main
    return taken


def ms_per_image(before: CpuSample, after: CpuSample, images: int) -> dict[str, float]:
    """Each role's CPU milliseconds per image over the run, and their sum (the load generator apart)."""
    if images <= 0:
        return {}
    totals: dict[str, float] = {}
    for pid, (role, seconds) in after.seconds.items():
        start = before.seconds.get(pid, (role, 0.0))[1]
        totals[role] = totals.get(role, 0.0) + max(0.0, seconds - start)
    table = {role: round(totals[role] * 1000.0 / images, 2) for role in ROLE_ORDER if role in totals}
    table.update(
        {
            role: round(seconds * 1000.0 / images, 2)
            for role, seconds in sorted(totals.items())
            if role.startswith(SHARD_ROLE)
        }
    )
    table["stack"] = round(sum(v for k, v in table.items() if k not in ("bench",)), 2)
    if after.redis_main:
        # Redis runs commands on one thread: with io-threads, the process's CPU is more than that one's.
        main = sum(max(0.0, s - before.redis_main.get(pid, 0.0)) for pid, s in after.redis_main.items())
        table["redis-main"] = round(main * 1000.0 / images, 2)
    if table.get("bench"):
        # The load generator does the same work per image in every run: the stack in its units moves with
        # the build, not with how fast this (shared, virtual) machine happens to run at the moment.
        table["stack/bench"] = round(table["stack"] / table["bench"], 2)
    return table


def cpu_times() -> list[int] | None:
    """The machine's CPU jiffies (user, nice, system, idle, iowait, irq, softirq, steal), or None."""
    try:
        with open("/proc/stat") as stat:
            return [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def cpu_shares(before: list[int] | None, after: list[int] | None) -> dict[str, float] | None:
    """Over the run, the share of the machine's CPU time that was busy, and stolen by the hypervisor:
    a run on a machine whose host took its cores away says so."""
    if not before or not after:
        return None
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta) or 1
    idle = delta[3] + delta[4]
    return {"busy": round((total - idle - delta[7]) / total, 3), "steal": round(delta[7] / total, 3)}


@dataclass(frozen=True)
class CpuScope:
    """Which processes of this machine are the deployment: a Redis port, and (a bench stack's) the
    process sessions of its roles; None: every local process of a role."""

    redis_port: int | None = 6379
    sessions: frozenset[int] | None = None
    shard_ports: tuple[int, ...] = ()  # the bulk shards' redis-servers (each reported as redis-shard<i>)
    port_roles: tuple[tuple[int, str], ...] = ()  # more redis-servers by port: (port, role)

    def sample(self) -> CpuSample:
        return sample(
            self.redis_port,
            os.getpid(),
            set(self.sessions) if self.sessions is not None else None,
            self.shard_ports,
            self.port_roles,
        )
