"""How `bench plane` reads what a phase cost: each Redis server's own counters (`INFO cpu`'s main thread,
`INFO commandstats`) around it, the product's processes' round trips to it (counted at their connections:
bench/meters/round_trips/sitecustomize.py), and, when asked, the control plane's instructions counted under
callgrind."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.stack.processes import RedisServer, wait_until

# The bench's own readings, left out of a phase's commands: its INFO around each phase, and its CLIENT LIST while the
# CPU worker starts (bench.meters.plane), which none of the product's processes sends.
BENCH_OWN = ("info", "client|list")


@dataclass
class RedisReading:
    """One Redis's own counters at one moment."""

    cpu_s: float  # its main thread's CPU (user + system), seconds
    calls: dict[str, int]
    usec: dict[str, int]
    round_trips: dict[str, int] = field(default_factory=dict)  # by process role, counted at the clients

    @classmethod
    def of(cls, client: redis.Redis, trips: RoundTripCounter | None = None) -> RedisReading:
        cpu: dict[str, Any] = client.info("cpu")
        stats: dict[str, Any] = client.info("commandstats")
        main = float(cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"])) + float(
            cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])
        )
        names = {name.removeprefix("cmdstat_"): value for name, value in stats.items()}
        return cls(
            main,
            {name: int(value["calls"]) for name, value in names.items() if name not in BENCH_OWN},
            {name: int(value["usec"]) for name, value in names.items() if name not in BENCH_OWN},
            trips.read(client.connection_pool.connection_kwargs["port"]) if trips else {},
        )


@dataclass
class PhaseCost:
    """What one phase cost one Redis, per image."""

    us: float  # main-thread CPU
    commands: float
    by_command: dict[str, tuple[float, float]] = field(default_factory=dict)  # name: (calls, µs in it)
    instructions: float | None = None  # user-space instructions of the Redis (--instructions: under callgrind)
    round_trips: dict[str, float] = field(default_factory=dict)  # by process role (api, cpu-worker, gpu-worker)

    @property
    def trips(self) -> float:
        return sum(self.round_trips.values())

    def per_second(self, seconds: float) -> PhaseCost:
        """This cost, measured over `seconds` of idle, as a rate."""
        instructions = self.instructions / seconds if self.instructions is not None else None
        trips = {role: n / seconds for role, n in self.round_trips.items()}
        return PhaseCost(self.us / seconds, self.commands / seconds, self.by_command, instructions, trips)

    @classmethod
    def between(cls, before: RedisReading, after: RedisReading, images: int) -> PhaseCost:
        calls = {name: after.calls[name] - before.calls.get(name, 0) for name in after.calls}
        by_command = {
            name: (n / images, (after.usec[name] - before.usec.get(name, 0)) / images)
            for name, n in sorted(calls.items(), key=lambda item: -item[1])
            if n > 0
        }
        trips = {role: (n - before.round_trips.get(role, 0)) / images for role, n in after.round_trips.items()}
        return cls(
            (after.cpu_s - before.cpu_s) * 1e6 / images,
            sum(calls.values()) / images,
            by_command,
            round_trips={role: n for role, n in sorted(trips.items()) if n},
        )


class PhaseMeter:
    """Each phase's cost, read from the Redis servers' own counters (and the clients' round trips) around it."""

    def __init__(
        self,
        client: redis.Redis,
        shards: list[redis.Redis],
        images: int,
        counter: InstructionCounter | None,
        trips: RoundTripCounter | None = None,
    ) -> None:
        self.client, self.shards, self.images, self.counter, self.trips = client, shards, images, counter, trips
        self.cache: ApartCache | None = None  # --cache-redis: the cache's own Redis, measured phase by phase too
        self.cache_costs: dict[str, PhaseCost] = {}
        self.cache_idle: PhaseCost | None = None  # what the cache Redis spends a second with nothing to do
        self.costs: dict[str, PhaseCost] = {}
        self.shard_costs: dict[str, PhaseCost] = {}
        self.seconds: dict[str, float] = {}
        self.phase_images: dict[str, int] = {}

    def measure(self, phase: str, work: Any, images: int | None = None) -> Any:
        """`work`'s cost per image; `images`: how many it carried, when not all of them (1: its cost in all)."""
        images = self.images if images is None else images
        self.phase_images[phase] = images
        if self.counter:
            self.counter.mark()
        before = RedisReading.of(self.client, self.trips)
        shards_before = [RedisReading.of(c, self.trips) for c in self.shards]
        cache_before = self.cache.reading(self.trips) if self.cache else None
        started = time.monotonic()
        value = work()
        self.seconds[phase] = time.monotonic() - started
        if self.cache and cache_before:
            self.cache_costs[phase] = self.cache.cost(cache_before, self.trips, images)
        self.costs[phase] = PhaseCost.between(before, RedisReading.of(self.client, self.trips), images)
        if self.counter:
            self.costs[phase].instructions = self.counter.mark() / images
        if self.shards:
            after = [RedisReading.of(c, self.trips) for c in self.shards]
            per_shard = [PhaseCost.between(b, a, images) for b, a in zip(shards_before, after)]
            self.shard_costs[phase] = PhaseCost(
                sum(p.us for p in per_shard),
                sum(p.commands for p in per_shard),
                round_trips=added_round_trips([p.round_trips for p in per_shard]),
            )
        return value

    def idle(self, seconds: float) -> PhaseCost:
        """What the control plane spends a second with nothing to do (heartbeats, sweeps, blocking pops timing out,
        Redis's own cron): priced into every phase for as long as it lasts, and taken out again by `net`."""
        if self.counter:
            self.counter.mark()
        before = RedisReading.of(self.client, self.trips)
        cache_before = self.cache.reading(self.trips) if self.cache else None
        time.sleep(seconds)
        if self.cache and cache_before:
            self.cache_idle = self.cache.cost(cache_before, self.trips, 1).per_second(seconds)
        idle = PhaseCost.between(before, RedisReading.of(self.client, self.trips), 1)
        idle.us, idle.commands = idle.us / seconds, idle.commands / seconds
        idle.round_trips = {role: n / seconds for role, n in idle.round_trips.items()}
        if self.counter:
            idle.instructions = self.counter.mark() / seconds
        return idle

    def net(self, idle: PhaseCost, costs: dict[str, PhaseCost] | None = None) -> dict[str, PhaseCost]:
        """Each phase's cost less the idle rate over its duration: what the images themselves cost (`costs`:
        another Redis's, the cache's, less its own idle)."""
        net = {}
        for phase, cost in (self.costs if costs is None else costs).items():
            share = self.seconds[phase] / self.phase_images.get(phase, self.images)
            instructions = None
            if cost.instructions is not None and idle.instructions is not None:
                instructions = cost.instructions - idle.instructions * share
            trips = {role: n - idle.round_trips.get(role, 0.0) * share for role, n in cost.round_trips.items()}
            net[phase] = PhaseCost(
                cost.us - idle.us * share, cost.commands - idle.commands * share, cost.by_command, instructions, trips
            )
        return net


class ApartCache:
    """`bench plane --cache-redis`: the result cache on a Redis of its own (cache.redis_url, allkeys-lru), its own
    counters and (with --instructions) its own callgrind, read around each phase as the control plane's are; its
    idle (the GPU worker's size export a beat, the API's miss flush a second) is not taken out."""

    def __init__(self, workdir: Path, root: Path, instructions: bool) -> None:
        folder = workdir / "cache-redis"
        folder.mkdir(parents=True, exist_ok=True)
        self.counter = InstructionCounter(folder) if instructions else None
        policy = ("--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru")
        wrapper = self.counter.wrapper() if self.counter else ()
        self.server = RedisServer(folder, extra_args=policy, wrapper=wrapper, root=root)
        if self.counter:
            self.counter.pid = self.server.process.pid
        self.client = redis.Redis.from_url(self.server.url)

    def reading(self, trips: RoundTripCounter | None) -> RedisReading:
        if self.counter:
            self.counter.mark()
        return RedisReading.of(self.client, trips)

    def cost(self, before: RedisReading, trips: RoundTripCounter | None, images: int) -> PhaseCost:
        cost = PhaseCost.between(before, RedisReading.of(self.client, trips), images)
        if self.counter:
            cost.instructions = self.counter.mark() / images
        return cost


def added_round_trips(counts: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for count in counts:
        for role, n in count.items():
            total[role] = total.get(role, 0.0) + n
    return total


class RoundTripCounter:
    """The product's processes' round trips to each Redis, counted at their connections: each process started with
    `env` counts its own in a file a port (bench/meters/round_trips/sitecustomize.py); `read` adds them up by role.
    Exact, where Redis's own counters are not (a read event may hold a pipelined block, or half a large one)."""

    HOOK = Path(__file__).resolve().parent / "round_trips"

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder

    def env(self, env: dict[str, str], role: str) -> dict[str, str]:
        path = env.get("PYTHONPATH", "")
        return {
            **env,
            "IMGSERVE_ROUND_TRIPS_DIR": str(self.folder),
            "IMGSERVE_ROUND_TRIPS_ROLE": role,
            "PYTHONPATH": os.pathsep.join(p for p in (str(self.HOOK), path) if p),
        }

    def read(self, port: int) -> dict[str, int]:
        """Round trips to the Redis on `port` so far, by role (every process of a role, its forked children too)."""
        totals: dict[str, int] = {}
        for path in self.folder.glob(f"*.{port}.*"):
            role = path.name.split(".")[0]
            totals[role] = totals.get(role, 0) + int.from_bytes(path.read_bytes()[:8] or b"\0", "little")
        return totals


class InstructionCounter:
    """The control plane's redis-server under callgrind: its user-space instructions between two marks, a figure
    this shared machine's drift does not move (µs do, by 15-20% from run to run). Each `callgrind_control -d` dumps
    what was counted since the last dump. The kernel's side of each round trip (the socket calls, ~20% of Redis's
    CPU here) is not counted."""

    def __init__(self, folder: Path, prefix: str = "redis") -> None:
        """`prefix`: the output files' name before `.PID` (bench instructions counts an API worker as `cg`)."""
        self.folder, self.prefix = folder, prefix
        self.pid = 0

    def wrapper(self) -> tuple[str, ...]:
        return ("valgrind", "--tool=callgrind", f"--callgrind-out-file={self.folder}/{self.prefix}.%p")

    def mark(self) -> int:
        """Instructions since the last mark (the first: since the start)."""
        pattern = f"{self.prefix}.{self.pid}.*"
        before = set(self.folder.glob(pattern))
        subprocess.run(["callgrind_control", "-d", str(self.pid)], check=True, capture_output=True, timeout=60)
        dump = wait_until(lambda: set(self.folder.glob(pattern)) - before, 60, what="a callgrind dump")
        path = next(iter(dump))
        wait_until(lambda: "\ntotals:" in path.read_text(), 60, what="the dump written")
        summary = next(line for line in path.read_text().splitlines() if line.startswith("summary:"))
        return int(summary.split()[1])
