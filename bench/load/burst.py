"""bench burst: the story's launch-night burst on make run's stack, three CPU pools side by side (issue 61).

    python -m bench burst --burst 120 --max 3

Each variant is make run's own stack (scripts/run-local, the sim device) started afresh: a fixed pool of one CPU
worker process (CPU_WORKERS=1), a fixed pool at the maximum (CPU_WORKERS=MAX), and the pool autoscaled on the
backlog between them (CPU_AUTOSCALE=1,MAX: tasks/hop/autoscale.py, Celery's shrink delay AUTOSCALE_KEEPALIVE shortened
to --keepalive-s). Idle, the CPU worker's resident memory (its main process and pool) is read; then `--burst`
1080p JPEGs are sent at once, each followed to its end by a long-poll, while the pool's size is read every 0.2 s;
then the stack idles until the pool is back at its minimum (or --idle-s passes). Printed: p95 against the SLA,
images/s over the burst, idle memory, how soon the pool grew to its maximum and shrank back.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench.stack.corpus import load_corpus
from bench.stack.cpu import read_process
from bench.stack.local import ProcfileStack, StackOptions
from bench.stack.processes import wait_until

SLA_MS = 800.0


@dataclass
class BurstRun:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    failed: int = 0
    burst_s: float = 0.0
    idle_rss_mib: float = 0.0
    pool: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the burst began, processes)
    grew_to_max_s: float | None = None
    back_to_min_s: float | None = None  # after the last job ended

    def p95_ms(self) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else float("nan")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process now (bench.stack.cpu's reading of /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (read := read_process(int(entry))) is not None:
            found[int(entry)] = (read[1], read[0])
    return found


def cpu_pool(session_pid: int) -> tuple[int | None, list[int]]:
    """The CPU worker's main process under this supervisor, and its pool's processes."""
    processes = _processes()

    def under_session(pid: int) -> bool:
        while pid in processes:
            if pid == session_pid:
                return True
            pid = processes[pid][0]
        return False

    def celery_cpu(cmdline: str) -> bool:  # the worker itself, not the Procfile line's shell around it
        return "cpu@" in cmdline and "celery" in cmdline and not cmdline.startswith("/bin/sh")

    mains = [
        pid
        for pid, (parent, cmdline) in processes.items()
        if celery_cpu(cmdline) and not celery_cpu(processes.get(parent, (0, ""))[1])
    ]
    main = next((pid for pid in mains if under_session(pid)), None)
    return main, [pid for pid, (parent, _) in processes.items() if main is not None and parent == main]


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            line = next(entry for entry in status if entry.startswith("VmRSS"))
        except (OSError, StopIteration):
            continue
        total += int(line.split()[1])
    return total / 1024.0


def run_variant(
    name: str,
    env: dict[str, str],
    cpu_workers: int | None,
    images: list[bytes],
    workdir: Path,
    minimum: int,
    maximum: int,
    idle_s: float,
) -> BurstRun:
    options = StackOptions(device="sim", cpu_workers=cpu_workers, env=env)
    stack = ProcfileStack(workdir / name.replace(" ", "-"), options).start()
    run = BurstRun(name)
    try:
        assert stack.supervisor is not None
        session = stack.supervisor.process.pid
        wait_until(lambda: len(cpu_pool(session)[1]) == (cpu_workers or minimum), 60, what=f"{name}: its idle pool")
        time.sleep(3.0)  # settled: imports done, caches warm
        main, children = cpu_pool(session)
        run.idle_rss_mib = _rss_mib([p for p in [main, *children] if p is not None])
        stop_sampling = threading.Event()
        started = time.monotonic()

        def sample() -> None:
            while not stop_sampling.is_set():
                run.pool.append((time.monotonic() - started, len(cpu_pool(session)[1])))
                stop_sampling.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        session_http = requests.Session()

        def one(image: bytes) -> float | None:
            sent = time.monotonic()
            reply = session_http.post(
                f"{stack.url}/v1/jobs?wait=30", data=image, headers={"Content-Type": "image/jpeg"}, timeout=60
            )
            if reply.status_code not in (200, 202):
                return None
            job = reply.json()
            while job.get("status") not in ("succeeded", "failed", "expired", "cancelled"):
                job = session_http.get(f"{stack.url}/v1/jobs/{job['id']}?wait=10", timeout=30).json()
            return (time.monotonic() - sent) * 1000.0 if job["status"] == "succeeded" else None

        with ThreadPoolExecutor(len(images)) as pool:
            results = list(pool.map(one, images))
        run.burst_s = time.monotonic() - started
        run.latencies_ms = [ms for ms in results if ms is not None]
        run.failed = sum(1 for ms in results if ms is None)
        ended = time.monotonic()
        deadline = ended + idle_s
        while time.monotonic() < deadline and (cpu_workers is not None or len(cpu_pool(session)[1]) > minimum):
            time.sleep(0.5)
            if cpu_workers is not None and time.monotonic() > ended + 2:
                break
        stop_sampling.set()
        sampler.join()
        run.pool.append((time.monotonic() - started, len(cpu_pool(session)[1])))  # as the wait above last saw it
        top = next((t for t, n in run.pool if n >= maximum), None)
        run.grew_to_max_s = top if cpu_workers is None else None
        if cpu_workers is None and run.pool and run.pool[-1][1] <= minimum:
            run.back_to_min_s = (
                next((t for t, n in run.pool if t >= run.burst_s and n <= minimum), run.pool[-1][0]) - run.burst_s
            )
    finally:
        stack.stop()
    return run


def markdown(runs: list[BurstRun], burst: int) -> str:
    lines = [
        f"## bench burst: {burst} 1080p JPEGs at once on make run's stack (sim device), each followed to its end",
        "",
        "| CPU pool | images/s | p95 ms (SLA 800) | failed | idle memory MiB (CPU worker) | grew to its maximum | "
        "back to its minimum after the burst |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        rate = len(run.latencies_ms) / run.burst_s if run.burst_s else 0.0
        grew = f"{run.grew_to_max_s:.1f} s" if run.grew_to_max_s is not None else "-"
        back = f"{run.back_to_min_s:.1f} s" if run.back_to_min_s is not None else "-"
        within = "within" if run.p95_ms() <= SLA_MS else "past"
        lines.append(
            f"| {run.name} | {rate:.1f} | {run.p95_ms():.0f} ({within}) | {run.failed} | {run.idle_rss_mib:.0f} | "
            f"{grew} | {back} |"
        )
    return "\n".join(lines)


def run(burst: int, maximum: int, keepalive_s: float, idle_s: float, workdir: Path) -> tuple[str, list[BurstRun]]:
    images = (load_corpus(None, count=min(burst, 24)) * (burst // 24 + 1))[:burst]
    variants: list[tuple[str, dict[str, str], int | None]] = [
        ("fixed 1", {}, 1),
        (f"fixed {maximum}", {}, maximum),
        (f"autoscaled 1..{maximum}", {"CPU_AUTOSCALE": f"1,{maximum}", "AUTOSCALE_KEEPALIVE": str(keepalive_s)}, None),
    ]
    runs = [run_variant(name, env, workers, images, workdir, 1, maximum, idle_s) for name, env, workers in variants]
    return markdown(runs, burst), runs


def summary(runs: list[BurstRun]) -> list[dict[str, Any]]:
    return [{**vars(run), "p95_ms": run.p95_ms()} for run in runs]
