"""`bench soak`'s records: a request as its client saw it, and a sample of every process of the stack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Request:
    phase: str
    started: float  # seconds since the soak began
    seconds: float  # submit to its end, as this client saw it
    status: str  # a job status, or "rejected" / "error"
    reason: str | None
    bill: dict[str, float] | None = None  # the job's time bill (timings_ms), where it succeeded


@dataclass
class Sample:
    t: float  # seconds since the soak began
    phase: str
    processes: dict[int, tuple[str, float, int, int]]  # pid -> (role, RSS MB, open descriptors, threads)
    redis_used_mb: float | None
    redis_keys: int | None
    stack_cpu_s: float = 0.0  # CPU seconds so far of the stack's processes, Redis included
    bench_cpu_s: float = 0.0  # and of this load generator
    machine: list[int] | None = None  # the machine's CPU jiffies (bench.stack.cpu.cpu_times)
