"""`bench soak`: make run's stack under a steady load for a long while, watched for what grows.

    python -m bench soak --minutes 30 --qps 15                     # the story's peak for half an hour
    python -m bench soak --minutes 30 --qps 15 --burst-qps 40      # then idle, a burst, idle again
    python -m bench soak --minutes 12 --qps 15 --set jobs.ttl_s=60 --set cache.ttl_s=60   # Redis's steady state

It starts exactly `make run`'s processes (bench.stack.local.ProcfileStack: the Procfile, Flower included) on a
private Redis with the `sim` device (the story's profile unless --profile), then offers Poisson arrivals at
--qps for --minutes, each request a new 1080p JPEG, submitted and long-polled to its end. The first
--warmup-minutes of that are the warm-up (imports, first allocations, pools filling): sampled, not fitted.
With --burst-qps: --idle-s without load, --burst-s at --burst-qps, --idle-s again, to see whether what a
burst took (descriptors, threads) comes back.

Every --sample-s it reads, for each process of the stack (grouped by role: bench.stack.cpu.sample, by command line),
its RSS, open descriptors and threads from /proc, and Redis's used_memory and key count. The report gives, per role,
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis

from bench.load import client as loader
from bench.soak.analysis import (
    ROLE_BOUNDS,
    ROLE_CEILINGS_MB,
    Phase,
    Request,
    Sample,
    SoakOptions,
    analyse,
)
from bench.soak.report import markdown, reanalyse, write
from bench.stack import cpu
from bench.stack.local import ProcfileStack, StackOptions


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
    """`taken`: the stack's processes by role and their CPU seconds (bench.stack.cpu.sample, this process as
    `bench`)."""
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


class PhasedLoad:
    """Poisson arrivals phase after phase, each request a new image, submitted and long-polled to its end."""

    def __init__(
        self, url: str, images: list[bytes], phases: list[Phase], begin: float, seed: int = 0, max_in_flight: int = 256
    ) -> None:
        self.url, self.phases, self.begin = url, phases, begin
        self.stream = loader.ImageStream(images, seed=seed)
        self.session = loader.session_for(max_in_flight)
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
        outcome = loader.request_once(self.session, self.url, self.stream.next(index))
        bill = outcome.doc.get("timings_ms") if outcome.ok and outcome.doc else None
        request = Request(phase, outcome.started - self.begin, outcome.latency_s, outcome.status, outcome.reason, bill)
        with self.lock:
            self.requests.append(request)


def run_soak(
    options: SoakOptions, stack_options: StackOptions, images: list[bytes], log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Start make run's stack, load it phase after phase while sampling, stop it; the analysis (see `analyse`)."""
    from contract.settings.config import load_settings

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
        [r.phase, round(r.started, 3), round(r.seconds, 4), r.status, r.reason, r.bill] for r in runner.requests
    ]
    return report


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
    if args.report:  # --window-s given beside it: the p95 windows at that length instead of the run's
        report = reanalyse(json.loads(args.report.read_text()), window_s=args.window_s)
        print(markdown(report))
        return 0 if report["passed"] else 1
    options = SoakOptions(
        minutes=args.minutes,
        qps=args.qps,
        warmup_minutes=args.warmup_minutes,
        sample_s=args.sample_s,
        window_s=args.window_s or 120.0,
        burst_qps=args.burst_qps,
        burst_s=args.burst_s,
        idle_s=args.idle_s,
        seed=args.seed,
        max_slope_mb_min={**ROLE_BOUNDS, **parse_role_values(args.max_slope_mb_min or "")},
        max_rss_mb={**ROLE_CEILINGS_MB, **parse_role_values(args.max_rss_mb or "")},
    )
    from bench.load.ab import setting_overlay
    from bench.stack.profiles import parse_profile

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
