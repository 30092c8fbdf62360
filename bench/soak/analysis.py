"""`bench soak`'s analysis: what a run's samples and requests say (slopes, verdicts, descriptors, Redis
against its TTLs, p95 per window), and the options and records it reads. The run itself: bench.soak.run; its report
as text: bench.soak.report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bench.soak.records import Request, Sample
from bench.soak.windows import p95_windows
from bench.stack import cpu

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
# (glibc keeps up to 64 MB freed at a heap's top: contract/runtime/memory.py): ~62 MB at start, ~70 at 15 jobs/s, ~80
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
    report["p95_windows"] = p95_windows(
        requests, samples, min(options.warmup_minutes, options.minutes) * 60.0, options.minutes * 60.0, options.window_s
    )
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
