"""`bench soak`: make run's stack under a steady load for a long while, watched for what grows.

    python -m bench soak --minutes 30 --qps 15                     # the story's peak for half an hour
    python -m bench soak --minutes 30 --qps 15 --burst-qps 40      # then idle, a burst, idle again
    python -m bench soak --minutes 12 --qps 15 --set jobs.ttl_s=60 --set cache.ttl_s=60   # Redis's steady state

It starts exactly `make run`'s processes (bench.stack.ProcfileStack: the Procfile, Flower included) on a
private Redis with the `sim` device (the story's profile unless --profile), then offers Poisson arrivals at
--qps for --minutes, each request a new 1080p JPEG, submitted and long-polled to its end. The first
--warmup-minutes of that are the warm-up (imports, first allocations, pools filling): sampled, not fitted.
With --burst-qps: --idle-s without load, --burst-s at --burst-qps, --idle-s again, to see whether what a
burst took (descriptors, threads) comes back.

Every --sample-s it reads, for each process of the stack (grouped by role: bench.cpu.sample, by command line), its RSS,
open descriptors and threads from /proc, and Redis's used_memory and key count. The report gives, per role,
the RSS at the start and the end of the fitted part and its least-squares slope in MB/min (the largest of
the role's processes, judged against the role's bound), and the slope of the last half too: a process whose
whole slope is within its bound is "flat"; one above it whose last half is within it "levelled off" (a pass
only where the role has a stated ceiling, --max-rss-mb, and stayed under it); else "growing". Then
descriptors and threads first against last (and before the burst against after it), Redis against what the
TTLs predict (rate x ttl x keys per job), p95 per window, jobs lost and processes restarted.

Exit status 1 when a role grows past its bound, a job was lost (accepted but not succeeded) or failed, or a
process of the stack was restarted; 0 otherwise. The bounds per role are in ROLE_BOUNDS (docs/operations.md
says why each).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench import cpu, load
from bench.stack import ProcfileStack, StackOptions
from contract.timebill import percentile

# MB per minute of RSS a process of each role may gain, by least squares over the fitted part. The GPU worker,
# the CPU workers and the callback worker keep nothing per job: 0.1 MB/min is ~100 bytes a job at 15/s, below
# any per-job record. The API, Flower and the supervisor too, once their pools and caches are full.
ROLE_BOUNDS: dict[str, float] = {
    "api": 0.1,
    "cpu-worker": 0.1,
    "gpu-worker": 0.1,
    "callback-worker": 0.1,
    "flower": 0.1,
    "supervisor": 0.1,
}
# Roles allowed to grow first and level off under a stated ceiling (MB of one process's RSS, the soak's own stack:
# sim device, the default model). Flower keeps the last `--max_tasks` tasks (the Procfile's 10,000: ~11 minutes
# at 15 jobs/s), then drops the oldest. A gunicorn worker keeps the high-water mark of the uploads it held at once
# (glibc keeps up to 64 MB freed at a heap's top: contract/memory.py): ~62 MB at start, ~70 at 15 jobs/s, ~80
# after a burst at 40. The GPU worker's allocators settle over its first ~6,000 jobs (~2 MB), then hold.
ROLE_CEILINGS_MB: dict[str, float] = {"flower": 160.0, "api": 128.0, "gpu-worker": 300.0}
# Redis keys a computed job leaves for the TTLs: its record (jobs.ttl_s) and its result-cache entry (cache.ttl_s).
KEYS_PER_JOB = {"record": 1, "cache entry": 1}


@dataclass(frozen=True)
class Phase:
    name: str  # warm-up, steady, idle, burst, after
    qps: float
    seconds: float
    drained: bool = False  # begins once every request sent before it has ended (a burst's backlog is not idle)


@dataclass
class SoakOptions:
    minutes: float = 30.0  # the steady load, warm-up included
    qps: float = 15.0
    warmup_minutes: float = 2.0
    sample_s: float = 15.0
    window_s: float = 120.0  # p95 per window of this length
    burst_qps: float = 0.0  # 0: no burst
    burst_s: float = 60.0
    idle_s: float = 90.0
    max_slope_mb_min: dict[str, float] = field(default_factory=lambda: dict(ROLE_BOUNDS))
    max_rss_mb: dict[str, float] = field(default_factory=lambda: dict(ROLE_CEILINGS_MB))
    seed: int = 0

    def phases(self) -> list[Phase]:
        warmup = min(self.warmup_minutes, self.minutes) * 60.0
        phases = [Phase("warm-up", self.qps, warmup), Phase("steady", self.qps, self.minutes * 60.0 - warmup)]
        if self.burst_qps > 0:
            phases += [
                Phase("idle", 0.0, self.idle_s, drained=True),
                Phase("burst", self.burst_qps, self.burst_s),
                Phase("after", 0.0, self.idle_s, drained=True),
            ]
        return [phase for phase in phases if phase.seconds > 0]


@dataclass
class Request:
    phase: str
    started: float  # seconds since the soak began
    seconds: float  # submit to its end, as this client saw it
    status: str  # a job status, or "rejected" / "error"
    reason: str | None


@dataclass
class Sample:
    t: float  # seconds since the soak began
    phase: str
    processes: dict[int, tuple[str, float, int, int]]  # pid -> (role, RSS MB, open descriptors, threads)
    redis_used_mb: float | None
    redis_keys: int | None
    stack_cpu_s: float = 0.0  # CPU seconds so far of the stack's processes, Redis included
    bench_cpu_s: float = 0.0  # and of this load generator
    machine: list[int] | None = None  # the machine's CPU jiffies (bench.cpu.cpu_times)


def process_figures(pid: int) -> tuple[float, int, int] | None:
    """RSS in MB, open descriptors and threads of a live process, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024.0, fds, int(fields["Threads"])


def take_sample(t: float, phase: str, taken: cpu.CpuSample, client: redis.Redis | None) -> Sample:
    """`taken`: the stack's processes by role and their CPU seconds (bench.cpu.sample, this process as `bench`)."""
    processes = {
        pid: (role, *figures)
        for pid, (role, _) in taken.seconds.items()
        if role not in ("redis", "bench") and (figures := process_figures(pid)) is not None
    }
    used = keys = None
    if client is not None:
        try:
            used, keys = int(client.info("memory")["used_memory"]) / 2**20, int(client.dbsize())
        except redis.RedisError:
            pass
    stack_cpu = sum(seconds for role, seconds in taken.seconds.values() if role != "bench")
    bench_cpu = sum(seconds for role, seconds in taken.seconds.values() if role == "bench")
    return Sample(t, phase, processes, used, keys, stack_cpu, bench_cpu, cpu.cpu_times())


def least_squares_slope(points: list[tuple[float, float]]) -> float | None:
    """The slope of the least-squares line through (x, y) points; None with fewer than three, or one x."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute; None with fewer than three."""
    slope = least_squares_slope(points)
    return None if slope is None else slope * 60.0


def verdict(
    slope: float | None,
    first_third: float | None,
    last_third: float | None,
    peak_mb: float,
    bound: float,
    ceiling: float | None,
) -> str:
    """flat: the slope within the bound. Levelled off: above it, but the last third's slope within the bound or a
    tenth of the first third's (a bounded structure filling, then full; a leak keeps its rate), and the peak under
    the role's stated ceiling: only a role with one passes so. Else growing, or over its ceiling."""
    if slope is None:
        return "too few samples"
    if ceiling is not None and peak_mb > ceiling:
        return "over its ceiling"
    if slope <= bound:
        return "flat"
    if last_third is not None and last_third <= max(bound, (first_third or 0.0) / 10.0):
        return "levelled off" if ceiling is not None else "levelled off, no stated ceiling"
    return "growing"


PASSING = ("flat", "levelled off")


def analyse(
    samples: list[Sample],
    requests: list[Request],
    options: SoakOptions,
    ttl: dict[str, float],
    key_bytes: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The figures and verdicts of a soak (see the module's docstring). `ttl`: seconds each kind of key in
    KEYS_PER_JOB lives unused; `key_bytes`: what key_sizes measured."""
    steady = [s for s in samples if s.phase == "steady"]
    roles = sorted(
        {role for s in samples for role, *_ in s.processes.values()},
        key=lambda r: cpu.ROLE_ORDER.index(r) if r in cpu.ROLE_ORDER else len(cpu.ROLE_ORDER),
    )
    report: dict[str, Any] = {"options": {k: v for k, v in asdict(options).items()}, "roles": {}}
    for role in roles:
        pids = sorted({pid for s in steady for pid, (r, *_) in s.processes.items() if r == role})
        bound = options.max_slope_mb_min.get(role, 0.1)
        ceiling = options.max_rss_mb.get(role)
        per_process = []
        for pid in pids:
            series = [(s.t, s.processes[pid][1]) for s in steady if pid in s.processes]
            third = len(series) // 3
            slope, first_third = slope_per_min(series), slope_per_min(series[: third + 1])
            last_third = slope_per_min(series[-(third + 1) :])
            peak = max(v for _, v in series)
            per_process.append(
                {
                    "pid": pid,
                    "first_mb": round(series[0][1], 1),
                    "last_mb": round(series[-1][1], 1),
                    "peak_mb": round(peak, 1),
                    "slope_mb_min": None if slope is None else round(slope, 3),
                    "first_third_mb_min": _round(first_third),
                    "last_third_mb_min": _round(last_third),
                    "verdict": verdict(slope, first_third, last_third, peak, bound, ceiling),
                }
            )
        worst = max(
            per_process, key=lambda p: p["slope_mb_min"] if p["slope_mb_min"] is not None else -1e9, default=None
        )
        totals = [(s.t, sum(v[1] for v in s.processes.values() if v[0] == role)) for s in steady]
        report["roles"][role] = {
            "processes": len(pids),
            "bound_mb_min": bound,
            "ceiling_mb": ceiling,
            "rss_first_mb": round(totals[0][1], 1) if totals else None,
            "rss_last_mb": round(totals[-1][1], 1) if totals else None,
            "rss_slope_mb_min": _round(slope_per_min(totals)),
            "worst": worst,
            "per_process": per_process,
            "verdict": "flat"
            if not per_process
            else next(
                (p["verdict"] for p in per_process if p["verdict"] not in PASSING),
                "levelled off" if any(p["verdict"] == "levelled off" for p in per_process) else "flat",
            ),
            **_descriptors_and_threads(samples, role),
        }
    report["restarts"] = _restarts(samples)
    report["requests"] = _requests(requests)
    report["p95_windows"] = _p95_windows(requests, options, samples)
    report["redis"] = _redis(samples, options, ttl)
    if report["redis"]:
        report["redis"]["key_bytes"] = key_bytes or {}
    report["passed"] = (
        all(r["verdict"] in PASSING for r in report["roles"].values())
        and not report["requests"]["lost"]
        and not report["requests"]["failed"]
        and not report["restarts"]
    )
    return report


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _role_totals(sample: Sample, role: str) -> tuple[int, int]:
    fds = sum(v[2] for v in sample.processes.values() if v[0] == role)
    threads = sum(v[3] for v in sample.processes.values() if v[0] == role)
    return fds, threads


def _descriptors_and_threads(samples: list[Sample], role: str) -> dict[str, Any]:
    """The role's descriptors and threads (summed over its processes) at the fitted part's first and last sample,
    and, with a burst, at the end of the idle before it, its peak during it, and at the end of the idle after."""
    steady = [s for s in samples if s.phase == "steady"]
    figures: dict[str, Any] = {}
    if steady:
        figures["fds_first"], figures["threads_first"] = _role_totals(steady[0], role)
        figures["fds_last"], figures["threads_last"] = _role_totals(steady[-1], role)
    before = [s for s in samples if s.phase == "idle"]
    burst = [s for s in samples if s.phase == "burst"]
    after = [s for s in samples if s.phase == "after"]
    if before and after:
        figures["fds_before_burst"], figures["threads_before_burst"] = _role_totals(before[-1], role)
        figures["fds_burst_peak"] = max((_role_totals(s, role)[0] for s in burst), default=None)
        figures["fds_after_burst"], figures["threads_after_burst"] = _role_totals(after[-1], role)
        figures["rss_before_burst_mb"] = round(sum(v[1] for v in before[-1].processes.values() if v[0] == role), 1)
        figures["rss_after_burst_mb"] = round(sum(v[1] for v in after[-1].processes.values() if v[0] == role), 1)
    return figures


def _restarts(samples: list[Sample]) -> dict[str, int]:
    """Per role, processes seen once that were gone later (a restart by the supervisor, a recycled child)."""
    gone: dict[str, int] = {}
    if not samples:
        return gone
    last = samples[-1].processes
    seen: dict[int, str] = {}
    for sample in samples:
        for pid, (role, *_) in sample.processes.items():
            seen.setdefault(pid, role)
    for pid, role in seen.items():
        if pid not in last:
            gone[role] = gone.get(role, 0) + 1
    return gone


def _requests(requests: list[Request]) -> dict[str, Any]:
    """Per phase: sent, succeeded, refused (429/503 at submit), and the rest; lost = accepted, not succeeded."""
    by_phase: dict[str, dict[str, int]] = {}
    for request in requests:
        tally = by_phase.setdefault(request.phase, {"sent": 0, "succeeded": 0, "refused": 0, "other": 0})
        tally["sent"] += 1
        if request.status == "succeeded":
            tally["succeeded"] += 1
        elif request.status == "rejected" and request.reason in ("http_429", "http_503"):
            tally["refused"] += 1
        else:
            tally["other"] += 1
    failed = [r for r in requests if r.status not in ("succeeded", "rejected")]
    reasons: dict[str, int] = {}
    for r in failed:
        reasons[f"{r.status}:{r.reason}"] = reasons.get(f"{r.status}:{r.reason}", 0) + 1
    # A submit refused otherwise than by the admission's 429/503 (a 5xx, a refused connection) failed too.
    other_rejects = [r for r in requests if r.status == "rejected" and r.reason not in ("http_429", "http_503")]
    return {"by_phase": by_phase, "lost": len(failed), "lost_reasons": reasons, "failed": len(other_rejects)}


def _p95_windows(requests: list[Request], options: SoakOptions, samples: list[Sample]) -> list[dict[str, Any]]:
    """p95 of the requests that succeeded, per window of the steady load (by when they were sent), and the cores
    the stack, this load generator and the machine's other processes used meanwhile (on a shared machine a
    neighbour's hour shows in the p95: this says when)."""
    warmup = min(options.warmup_minutes, options.minutes) * 60.0
    steady = [r for r in requests if r.phase == "steady" and r.status == "succeeded"]
    windows: list[dict[str, Any]] = []
    start = warmup
    end = options.minutes * 60.0
    while start < end - 1e-9:
        stop = min(end, start + options.window_s)
        taken = sorted(r.seconds * 1000.0 for r in steady if start <= r.started < stop)
        if taken:
            windows.append(
                {
                    "from_s": round(start),
                    "to_s": round(stop),
                    "jobs": len(taken),
                    "p50_ms": round(percentile(taken, 50)),
                    "p95_ms": round(percentile(taken, 95)),
                    **_cores(samples, start, stop),
                }
            )
        start = stop
    if windows:
        first = windows[0]["p95_ms"]
        for window in windows:
            window["vs_first"] = round(window["p95_ms"] / first, 3) if first else None
    return windows


def _cores(samples: list[Sample], start: float, stop: float) -> dict[str, float]:
    """Cores used between the samples nearest `start` and `stop`: by the stack, the bench, everything else."""
    inside = [s for s in samples if start - 1e-6 <= s.t <= stop + 1e-6]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    seconds = last.t - first.t
    shares = cpu.cpu_shares(first.machine, last.machine)
    if seconds <= 0 or shares is None:
        return {}
    machine = shares["busy"] * (os.cpu_count() or 1)
    stack = (last.stack_cpu_s - first.stack_cpu_s) / seconds
    bench = (last.bench_cpu_s - first.bench_cpu_s) / seconds
    return {
        "stack_cores": round(stack, 2),
        "bench_cores": round(bench, 2),
        "other_cores": round(max(0.0, machine - stack - bench), 2),
        "steal": shares["steal"],
    }


def key_sizes(client: redis.Redis, namespace: str, sample: int = 50) -> dict[str, float]:
    """Mean bytes Redis holds (MEMORY USAGE) for a job record and a result-cache entry, over a sample of each, and
    per entry for the cache's bookkeeping (its LRU member and size field)."""
    sizes: dict[str, float] = {}
    try:
        for kind, pattern in (("record", f"{namespace}:job:*"), ("cache entry", f"{namespace}:cache:e:*")):
            found = []
            for key in client.scan_iter(match=pattern, count=1000):
                if not key.endswith(b":upload"):
                    found.append(key)
                if len(found) >= sample:
                    break
            used = [client.memory_usage(key, samples=0) or 0 for key in found]
            if used:
                sizes[kind] = round(sum(used) / len(used))
        members = client.zcard(f"{namespace}:cache:lru")
        sizes["cache lru members"] = members
        if members:
            bookkeeping = sum(
                client.memory_usage(f"{namespace}:cache:{name}", samples=0) or 0 for name in ("lru", "sizes")
            )
            sizes["cache bookkeeping"] = round(bookkeeping / members)
    except redis.RedisError:
        pass
    return sizes


def _redis(samples: list[Sample], options: SoakOptions, ttl: dict[str, float]) -> dict[str, Any]:
    """Redis's memory and keys, first and last of the steady load and their slope over its last half, against
    what the TTLs predict once every kind of key has lived its TTL: rate x ttl x keys per job, in keys, and in MB
    at the bytes per key the run itself measured."""
    measured = [s for s in samples if s.redis_keys is not None and s.redis_used_mb is not None]
    if not measured:
        return {}
    steady = [s for s in measured if s.phase in ("warm-up", "steady")]
    start = measured[0]
    last = steady[-1] if steady else measured[-1]
    per_job = sum(options.qps * ttl.get(kind, 0.0) * count for kind, count in KEYS_PER_JOB.items())
    predicted_keys = (start.redis_keys or 0) + per_job
    # Bytes per key: the slope of used_memory against the keys over the load, so that the uploads and frames in
    # flight at one sample or another (0.8 MB each) weigh little.
    # Before the shortest TTL, while the keys still grow: on a plateau the fit has nothing to go by.
    growing = [s for s in steady if not ttl or s.t <= min(ttl.values())]
    fitted = least_squares_slope(
        [
            (float(s.redis_keys or 0), (s.redis_used_mb or 0.0) * 2**20)
            for s in (growing if len(growing) >= 3 else steady)
        ]
    )
    bytes_per_key = fitted if fitted is not None and fitted > 0 else None
    half = [s for s in steady if s.phase == "steady"]
    half = half[len(half) // 2 :]
    loaded_s = options.minutes * 60.0
    levels_by_s = max(ttl.values()) if ttl else None
    return {
        "start_mb": round(start.redis_used_mb or 0, 1),
        "start_keys": start.redis_keys,
        "last_mb": round(last.redis_used_mb or 0, 1),
        "last_keys": last.redis_keys,
        "end_mb": round(measured[-1].redis_used_mb or 0, 1),
        "end_keys": measured[-1].redis_keys,
        "ttl_s": ttl,
        "keys_per_job": sum(KEYS_PER_JOB.values()),
        "predicted_keys": round(predicted_keys),
        "bytes_per_key": round(bytes_per_key) if bytes_per_key else None,
        "predicted_mb": round(
            (start.redis_used_mb or 0) + (predicted_keys - (start.redis_keys or 0)) * bytes_per_key / 2**20, 1
        )
        if bytes_per_key
        else None,
        "levels_off_after_s": levels_by_s,
        "ran_past_ttl": levels_by_s is not None and loaded_s > levels_by_s,
        "keys_slope_last_half_per_min": _round(slope_per_min([(s.t, float(s.redis_keys or 0)) for s in half]), 1),
        "mb_slope_last_half_per_min": _round(slope_per_min([(s.t, s.redis_used_mb or 0.0) for s in half])),
        "series": [(round(s.t), s.phase, round(s.redis_used_mb or 0, 2), s.redis_keys) for s in measured],
    }


class PhasedLoad:
    """Poisson arrivals phase after phase, each request a new image, submitted and long-polled to its end."""

    def __init__(
        self, url: str, images: list[bytes], phases: list[Phase], begin: float, seed: int = 0, max_in_flight: int = 256
    ) -> None:
        self.url, self.phases, self.begin = url, phases, begin
        self.stream = load.ImageStream(images, seed=seed)
        self.session = load.session_for(max_in_flight)
        self.rng = random.Random(seed)
        self.max_in_flight = max_in_flight
        self.requests: list[Request] = []
        self.sent = 0
        self.lock = threading.Lock()
        self.phase = phases[0].name if phases else ""

    def run(self, on_phase: Callable[[Phase], None] = lambda phase: None) -> None:
        index = 0
        with ThreadPoolExecutor(self.max_in_flight) as pool:
            phase_start = time.monotonic()
            for phase in self.phases:
                if phase.drained:
                    self.phase = "drain"
                    self._drain()
                    phase_start = max(phase_start, time.monotonic())
                self.phase = phase.name
                on_phase(phase)
                phase_end = phase_start + phase.seconds
                at = phase_start
                while phase.qps > 0:
                    at += self.rng.expovariate(phase.qps)
                    if at >= phase_end:
                        break
                    delay = at - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    pool.submit(self._fire, phase.name, index)
                    index += 1
                    self.sent = index
                delay = phase_end - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                phase_start = phase_end

    def _drain(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.requests) < self.sent and time.monotonic() < deadline:
            time.sleep(0.2)

    def _fire(self, phase: str, index: int) -> None:
        outcome = load.request_once(self.session, self.url, self.stream.next(index))
        request = Request(phase, outcome.started - self.begin, outcome.latency_s, outcome.status, outcome.reason)
        with self.lock:
            self.requests.append(request)


def run_soak(
    options: SoakOptions, stack_options: StackOptions, images: list[bytes], log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Start make run's stack, load it phase after phase while sampling, stop it; the analysis (see `analyse`)."""
    from contract.config import load_settings

    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    stack = ProcfileStack(workdir, stack_options).start()
    settings = load_settings(workdir / "config.yaml")
    ttl = {
        "record": float(settings.jobs.ttl_s),
        "cache entry": float(settings.cache.ttl_s if settings.cache.enabled else 0.0),
    }
    samples: list[Sample] = []
    stop = threading.Event()
    assert stack.redis is not None and stack.supervisor is not None
    client = redis.Redis(port=stack.redis.port)
    sessions = {stack.supervisor.process.pid}
    begin = time.monotonic()
    phases = options.phases()
    runner = PhasedLoad(stack.url, images, phases, begin, seed=options.seed)
    measured_keys: dict[str, float] = {}

    def on_phase(phase: Phase) -> None:
        log(f"phase {phase.name}: {phase.qps:g} QPS for {phase.seconds:.0f} s")
        if phase.name not in ("warm-up", "steady") and not measured_keys:  # the steady load's keys, still alive
            measured_keys.update(key_sizes(client, settings.namespace))

    def sampler() -> None:
        next_at = begin
        while not stop.is_set():
            taken = cpu.sample(stack.redis.port if stack.redis else None, os.getpid(), sessions)
            samples.append(take_sample(time.monotonic() - begin, runner.phase, taken, client))
            last = samples[-1]
            log(
                f"{last.t / 60:5.1f} min {last.phase:8} "
                + " ".join(
                    f"{role} {sum(v[1] for v in last.processes.values() if v[0] == role):.0f}"
                    for role in cpu.ROLE_ORDER
                    if any(v[0] == role for v in last.processes.values())
                )
                + f" MB; redis {last.redis_used_mb or 0:.1f} MB {last.redis_keys} keys; {len(runner.requests)} done"
            )
            next_at += options.sample_s
            stop.wait(max(0.0, next_at - time.monotonic()))

    watcher = threading.Thread(target=sampler, name="soak-sampler", daemon=True)
    watcher.start()
    try:
        runner.run(on_phase=on_phase)
        # What was still in flight ends within its long-poll; then the last sample.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(runner.requests) < runner.sent:
            time.sleep(0.5)
        if not measured_keys:
            measured_keys.update(key_sizes(client, settings.namespace))
    finally:
        stop.set()
        watcher.join()
        stack.stop()
    report = analyse(samples, runner.requests, options, ttl, measured_keys)
    report["stack"] = stack_options.describe()
    report["samples"] = [asdict(s) for s in samples]
    report["requests_log"] = [
        [r.phase, round(r.started, 3), round(r.seconds, 4), r.status, r.reason] for r in runner.requests
    ]
    return report


def reanalyse(saved: dict[str, Any]) -> dict[str, Any]:
    """A report written by `write`, analysed again from its samples (and its requests, where it kept them): the
    figures of a run under this checkout's rules."""
    fields = {name: value for name, value in saved["options"].items() if name in SoakOptions.__dataclass_fields__}
    options = SoakOptions(**fields)
    samples = [
        Sample(**{**s, "processes": {int(pid): tuple(v) for pid, v in s["processes"].items()}})
        for s in saved["samples"]
    ]
    requests = [Request(*r) for r in saved.get("requests_log", [])]
    redis_part = saved.get("redis") or {}
    report = analyse(samples, requests, options, redis_part.get("ttl_s", {}), redis_part.get("key_bytes"))
    if "requests_log" not in saved:  # written before reports kept their requests: their figures as they were
        report["requests"], report["p95_windows"] = saved["requests"], saved["p95_windows"]
        report["passed"] = (
            all(r["verdict"] in PASSING for r in report["roles"].values())
            and not report["requests"]["lost"]
            and not report["requests"]["failed"]
            and not report["restarts"]
        )
    report["stack"] = saved.get("stack", "")
    report["samples"] = saved["samples"]
    return report


def markdown(report: dict[str, Any]) -> str:
    """The report as the terminal shows it."""
    options = report["options"]
    burst = f", then a burst at {options['burst_qps']:g} QPS" if options["burst_qps"] else ""
    lines = [
        f"# Soak: {options['minutes']:g} min at {options['qps']:g} QPS ({options['warmup_minutes']:g} min "
        f"warm-up not fitted){burst}",
        "",
        f"Stack: make run's processes, {report.get('stack', '')}",
        "",
        "## RSS by role (MB; slope by least squares over the steady load after the warm-up)",
        "",
        "| role | procs | first | last | slope MB/min (sum) | worst process: slope; first, last third | bound "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for role, r in report["roles"].items():
        worst = r["worst"] or {}
        bound = f"{r['bound_mb_min']:g}" + (f", <= {r['ceiling_mb']:g} MB" if r["ceiling_mb"] else "")
        lines.append(
            f"| {role} | {r['processes']} | {r['rss_first_mb']} | {r['rss_last_mb']} | "
            f"{_fmt(r['rss_slope_mb_min'])} | {_fmt(worst.get('slope_mb_min'))}; "
            f"{_fmt(worst.get('first_third_mb_min'))}, {_fmt(worst.get('last_third_mb_min'))} "
            f"(pid {worst.get('pid')}, {worst.get('first_mb')} -> {worst.get('last_mb')}) | {bound} | "
            f"{r['verdict']} |"
        )
    lines += [
        "",
        "## Descriptors and threads (summed over each role's processes)",
        "",
        "| role | fds first -> last | threads first -> last | fds before burst -> peak -> after | "
        "threads before -> after | RSS MB before burst -> after |",
        "|---|---|---|---|---|---|",
    ]
    for role, r in report["roles"].items():
        burst = (
            (
                f"{r['fds_before_burst']} -> {r['fds_burst_peak']} -> {r['fds_after_burst']} | "
                f"{r['threads_before_burst']} -> {r['threads_after_burst']} | "
                f"{r['rss_before_burst_mb']} -> {r['rss_after_burst_mb']}"
            )
            if "fds_after_burst" in r
            else "- | - | -"
        )
        lines.append(
            f"| {role} | {r.get('fds_first')} -> {r.get('fds_last')} | "
            f"{r.get('threads_first')} -> {r.get('threads_last')} | {burst} |"
        )
    redis_part = report.get("redis") or {}
    if redis_part:
        lines += [
            "",
            "## Redis",
            "",
            f"- used_memory {redis_part['start_mb']} MB, {redis_part['start_keys']} keys at the start -> "
            f"{redis_part['last_mb']} MB, {redis_part['last_keys']} keys at the end of the steady load -> "
            f"{redis_part['end_mb']} MB, {redis_part['end_keys']} keys at the end",
            f"- the TTLs predict {redis_part['predicted_keys']} keys once every key has lived its TTL "
            f"({options['qps']:g}/s x ttl x {redis_part['keys_per_job']} keys per job; TTLs "
            f"{', '.join(f'{k} {v:g} s' for k, v in redis_part['ttl_s'].items())})"
            + (
                f", ~{redis_part['predicted_mb']} MB at the {redis_part['bytes_per_key']} bytes per key measured"
                if redis_part.get("predicted_mb")
                else ""
            ),
            "- Redis's own count (MEMORY USAGE), bytes: "
            + (", ".join(f"{k} {v:g}" for k, v in redis_part.get("key_bytes", {}).items()) or "-"),
            f"- over the last half of the steady load: {_fmt(redis_part['keys_slope_last_half_per_min'])} "
            f"keys/min, {_fmt(redis_part['mb_slope_last_half_per_min'])} MB/min "
            + (
                "(the run outlasted the TTLs: this is the steady state)"
                if redis_part["ran_past_ttl"]
                else f"(the TTLs are longer than the run: it levels off after {redis_part['levels_off_after_s']:g} s)"
            ),
        ]
    lines += [
        "",
        "## p95 per window (succeeded requests, by when they were sent)",
        "",
        "| from s | to s | jobs | p50 ms | p95 ms | p95 / first window's | cores: stack, bench, others |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in report["p95_windows"]:
        lines.append(
            f"| {w['from_s']} | {w['to_s']} | {w['jobs']} | {w['p50_ms']} | {w['p95_ms']} | {w['vs_first']} "
            f"| {w.get('stack_cores', '-')}, {w.get('bench_cores', '-')}, {w.get('other_cores', '-')} |"
        )
    requests = report["requests"]
    lines += ["", "## Requests and restarts", ""]
    for phase, tally in requests["by_phase"].items():
        lines.append(
            f"- {phase}: {tally['sent']} sent, {tally['succeeded']} succeeded, {tally['refused']} refused "
            f"(429/503), {tally['other']} other"
        )
    lines.append(
        f"- lost (accepted, not succeeded): {requests['lost']} {requests['lost_reasons'] or ''}; "
        f"failed submits: {requests['failed']}"
    )
    lines.append(f"- processes gone during the run (restarted): {report['restarts'] or 'none'}")
    lines += ["", "**PASSED**" if report["passed"] else "**FAILED**: " + "; ".join(_failures(report))]
    return "\n".join(lines)


def _failures(report: dict[str, Any]) -> list[str]:
    found = [
        f"{role} {r['verdict']} (worst {r['worst']['slope_mb_min'] if r['worst'] else '?'} MB/min, bound "
        f"{r['bound_mb_min']:g})"
        for role, r in report["roles"].items()
        if r["verdict"] not in PASSING
    ]
    if report["requests"]["lost"]:
        found.append(f"{report['requests']['lost']} jobs lost")
    if report["requests"]["failed"]:
        found.append(f"{report['requests']['failed']} submits failed")
    if report["restarts"]:
        found.append(f"restarts {report['restarts']}")
    return found


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}" if isinstance(value, float) else str(value)


def write(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y%m%d-%H%M%S')}-soak.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    (path.with_suffix(".md")).write_text(markdown(report) + "\n")
    return path


def parse_role_values(text: str) -> dict[str, float]:
    """ROLE=X[,ROLE=X...], or a bare X for every role."""
    values: dict[str, float] = {}
    for part in filter(None, (part.strip() for part in text.split(","))):
        role, sep, value = part.partition("=")
        if not sep:
            values.update(dict.fromkeys(ROLE_BOUNDS, float(role)))
        else:
            values[role.strip()] = float(value)
    return values


def main_soak(args: Any, images: list[bytes]) -> int:
    """`python -m bench soak` (its arguments: bench/__main__.py)."""
    if args.report:
        report = reanalyse(json.loads(args.report.read_text()))
        print(markdown(report))
        return 0 if report["passed"] else 1
    options = SoakOptions(
        minutes=args.minutes,
        qps=args.qps,
        warmup_minutes=args.warmup_minutes,
        sample_s=args.sample_s,
        window_s=args.window_s,
        burst_qps=args.burst_qps,
        burst_s=args.burst_s,
        idle_s=args.idle_s,
        seed=args.seed,
        max_slope_mb_min={**ROLE_BOUNDS, **parse_role_values(args.max_slope_mb_min or "")},
        max_rss_mb={**ROLE_CEILINGS_MB, **parse_role_values(args.max_rss_mb or "")},
    )
    from bench.ab import setting_overlay
    from bench.profiles import parse_profile

    extra = setting_overlay(args.set)
    stack = StackOptions(
        device="sim",
        cpu_workers=args.cpu_workers,
        sim_profile_ms=parse_profile(args.profile) if args.profile else None,
        extra=extra,
    )
    report = run_soak(options, stack, images, log=lambda line: print(f"  {line}", file=sys.stderr))
    path = write(report, args.out)
    print(markdown(report) + f"\n\nFiles: {path}, {path.with_suffix('.md')}")
    return 0 if report["passed"] else 1
