"""How `bench plane` reads what a phase cost: each Redis server's own counters (`INFO cpu`'s main thread,
`INFO commandstats`) around it, and, when asked, the control plane's instructions counted under callgrind."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.processes import wait_until


@dataclass
class RedisReading:
    """One Redis's own counters at one moment."""

    cpu_s: float  # its main thread's CPU (user + system), seconds
    calls: dict[str, int]
    usec: dict[str, int]

    @classmethod
    def of(cls, client: redis.Redis) -> RedisReading:
        cpu: dict[str, Any] = client.info("cpu")
        stats: dict[str, Any] = client.info("commandstats")
        main = float(cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"])) + float(
            cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])
        )
        names = {name.removeprefix("cmdstat_"): value for name, value in stats.items()}
        return cls(
            main,
            {name: int(value["calls"]) for name, value in names.items() if name != "info"},
            {name: int(value["usec"]) for name, value in names.items() if name != "info"},
        )


@dataclass
class PhaseCost:
    """What one phase cost one Redis, per image."""

    us: float  # main-thread CPU
    commands: float
    by_command: dict[str, tuple[float, float]] = field(default_factory=dict)  # name: (calls, µs in it)
    instructions: float | None = None  # user-space instructions of the Redis (--instructions: under callgrind)

    @classmethod
    def between(cls, before: RedisReading, after: RedisReading, images: int) -> PhaseCost:
        calls = {name: after.calls[name] - before.calls.get(name, 0) for name in after.calls}
        by_command = {
            name: (n / images, (after.usec[name] - before.usec.get(name, 0)) / images)
            for name, n in sorted(calls.items(), key=lambda item: -item[1])
            if n > 0
        }
        return cls((after.cpu_s - before.cpu_s) * 1e6 / images, sum(calls.values()) / images, by_command)


class PhaseMeter:
    """Each phase's cost, read from the Redis servers' own counters around it."""

    def __init__(
        self, client: redis.Redis, shards: list[redis.Redis], images: int, counter: InstructionCounter | None
    ) -> None:
        self.client, self.shards, self.images, self.counter = client, shards, images, counter
        self.costs: dict[str, PhaseCost] = {}
        self.shard_costs: dict[str, PhaseCost] = {}
        self.seconds: dict[str, float] = {}

    def measure(self, phase: str, work: Any) -> Any:
        if self.counter:
            self.counter.mark()
        before = RedisReading.of(self.client)
        shards_before = [RedisReading.of(c) for c in self.shards]
        started = time.monotonic()
        value = work()
        self.seconds[phase] = time.monotonic() - started
        self.costs[phase] = PhaseCost.between(before, RedisReading.of(self.client), self.images)
        if self.counter:
            self.costs[phase].instructions = self.counter.mark() / self.images
        if self.shards:
            after = [RedisReading.of(c) for c in self.shards]
            per_shard = [PhaseCost.between(b, a, self.images) for b, a in zip(shards_before, after)]
            self.shard_costs[phase] = PhaseCost(sum(p.us for p in per_shard), sum(p.commands for p in per_shard))
        return value

    def idle(self, seconds: float) -> PhaseCost:
        """What the control plane spends a second with nothing to do (heartbeats, sweeps, blocking pops timing out,
        Redis's own cron): priced into every phase for as long as it lasts, and taken out again by `net`."""
        if self.counter:
            self.counter.mark()
        before = RedisReading.of(self.client)
        time.sleep(seconds)
        idle = PhaseCost.between(before, RedisReading.of(self.client), 1)
        idle.us, idle.commands = idle.us / seconds, idle.commands / seconds
        if self.counter:
            idle.instructions = self.counter.mark() / seconds
        return idle

    def net(self, idle: PhaseCost) -> dict[str, PhaseCost]:
        """Each phase's cost less the idle rate over its duration: what the images themselves cost."""
        net = {}
        for phase, cost in self.costs.items():
            share = self.seconds[phase] / self.images
            instructions = None
            if cost.instructions is not None and idle.instructions is not None:
                instructions = cost.instructions - idle.instructions * share
            net[phase] = PhaseCost(
                cost.us - idle.us * share, cost.commands - idle.commands * share, cost.by_command, instructions
            )
        return net


class InstructionCounter:
    """The control plane's redis-server under callgrind: its user-space instructions between two marks, a figure
    this shared machine's drift does not move (µs do, by 15-20% from run to run). Each `callgrind_control -d` dumps
    what was counted since the last dump. The kernel's side of each round trip (the socket calls, ~20% of Redis's
    CPU here) is not counted."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pid = 0

    def wrapper(self) -> tuple[str, ...]:
        return ("valgrind", "--tool=callgrind", f"--callgrind-out-file={self.folder}/redis.%p")

    def mark(self) -> int:
        """Instructions since the last mark (the first: since the start)."""
        before = set(self.folder.glob(f"redis.{self.pid}.*"))
        subprocess.run(["callgrind_control", "-d", str(self.pid)], check=True, capture_output=True, timeout=60)
        dump = wait_until(lambda: set(self.folder.glob(f"redis.{self.pid}.*")) - before, 60, what="a callgrind dump")
        path = next(iter(dump))
        wait_until(lambda: "\ntotals:" in path.read_text(), 60, what="the dump written")
        summary = next(line for line in path.read_text().splitlines() if line.startswith("summary:"))
        return int(summary.split()[1])
