"""The GPU worker's host time by stage: what each batch costs the host, and where.

Each stage runs in one thread (collect/stage, device, finish) and adds the
wall time it took and the CPU time its thread spent, so wall minus CPU is the
time it waited (on Redis, on the device, on the GIL). The totals are published
with the worker's counters; `bench feed` divides them by the batches.
"""

from __future__ import annotations

import time
from types import TracebackType

from contract.jobs.timebill import HOST_STAGES, host_counter_fields
from contract.redis.clock import now as service_now
from gpu_worker.stats import BusyMeter, RecentStats


class HostTime:
    """Running totals of wall and thread-CPU seconds per stage."""

    def __init__(self) -> None:
        self.wall_s = dict.fromkeys(HOST_STAGES, 0.0)
        self.cpu_s = dict.fromkeys(HOST_STAGES, 0.0)
        self._timers = {stage: _Timer(self, stage) for stage in HOST_STAGES}

    def __call__(self, stage: str) -> _Timer:
        """`with host_time("write"): ...` adds the block's times to the stage."""
        return self._timers[stage]

    def add(self, stage: str, wall_s: float, cpu_s: float) -> None:
        self.wall_s[stage] += wall_s
        self.cpu_s[stage] += cpu_s

    def counters(self) -> dict[str, float]:
        """The totals as the counters hash's host_wall_s:<stage> and host_cpu_s:<stage> fields."""
        return host_counter_fields(self.wall_s, self.cpu_s)


class _Timer:
    """Not re-entrant per stage; each stage is timed by the one thread that runs it."""

    __slots__ = ("clock", "stage", "wall", "cpu")

    def __init__(self, clock: HostTime, stage: str) -> None:
        self.clock, self.stage = clock, stage
        self.wall = self.cpu = 0.0

    def __enter__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.clock.add(self.stage, time.perf_counter() - self.wall, time.thread_time() - self.cpu)


def worker_counters(busy: BusyMeter, recent: RecentStats, host_times: list[HostTime]) -> dict[str, float]:
    """The worker's counters hash (Keys.gpu_counters) as its heartbeat writes it, in the step that finds its epoch
    still its own (a fenced worker writes none): running totals and the host time by stage. (Each model's frames
    answered are the batch write's: gpu_worker.finish.)"""
    return {
        "device_seconds_total": round(busy.total_s, 6),
        "batches_total": recent.batches_total,
        "frames_total": recent.frames_total,
        "updated_at": service_now(),
        **combined_counters(host_times),
    }


def combined_counters(host_times: list[HostTime]) -> dict[str, float]:
    """Several lanes' totals (one per model a worker serves, each timed by its own threads) as one."""
    wall = {stage: sum(clock.wall_s[stage] for clock in host_times) for stage in HOST_STAGES}
    cpu = {stage: sum(clock.cpu_s[stage] for clock in host_times) for stage in HOST_STAGES}
    return host_counter_fields(wall, cpu)
