"""`bench diagnose`: the story's checklist, run against a live deployment.

1. Is traffic arriving?  2. Is the model on the GPU?  3. What does one
inference cost?  4. How do throughput, p95 and GPU busy % move with
concurrency (a serial pattern? a lock or I/O pattern?)  5. The time bill and
its largest stage.  6. The utilisation band and what to change.
"""

from __future__ import annotations

import time

import requests

from bench import cpu, load
from bench.floor import against_floor, decode_floor_ms
from bench.floor import describe as describe_floor
from bench.report import summarise
from bench.runs import CpuScope

BANDS = (
    (0.20, "< 20%: the bottleneck is outside the GPU; do not touch GPU settings yet"),
    (0.60, "20-60%: the data pipeline or batching holds the GPU back; keep pushing"),
    (0.90, "60-90%: healthy; the GPU is the main bottleneck, gains are in kernels and memory bandwidth"),
    (1.01, "> 90%: near saturation; watch tail latency and queueing"),
)

ADVICE = {
    "receive": "uploads are slow to arrive or parse: check the network, client uploads and API threads",
    "queue_cpu": "CPU workers are the bottleneck: add Celery concurrency or cpu-worker containers",
    "decode": "decode dominates: smaller uploads, more CPU workers, or JPEG draft mode (on by default)",
    "resize": "letterboxing dominates: more CPU workers; check Pillow-SIMD is installed",
    "backpressure": "the frame list is full: the GPU workers are saturated; add one, or raise max_batch_size "
    "(raising backpressure.max_frames only moves the wait into the list)",
    "queue_gpu": "frames wait for the GPU: it is saturated; add a GPU worker or raise max_batch_size",
    "batch_wait": "frames gather into batches: near window_ms, a shorter window helps; far beyond it, a busy "
    "device kept the batches gathering (add a GPU worker or raise max_batch_size)",
    "device_queue": "closed batches wait for a busy device: add a GPU worker or raise max_batch_size "
    "(a shorter window would not help)",
    "infer": "the model itself dominates: a smaller model, half precision, or a faster device",
    "postprocess": "post-processing dominates: raise conf, lower max_candidates",
}


def band(busy: float | None) -> str:
    if busy is None:
        return "unknown: no GPU busy figure from this deployment"
    return next(text for limit, text in BANDS if busy < limit)


def diagnose(
    url: str,
    images: list[bytes],
    sweep: tuple[int, ...] = (1, 8, 32),
    step_s: float = 10.0,
    scope: CpuScope | None = CpuScope(),
) -> str:
    lines = [f"# diagnose {url}", ""]
    lines.append(f"1. Traffic: {_rate(url)}")
    lines.append(f"2. Model placement: {_placement(url)}")
    before = load.gpu_counters(url)
    outcomes = load.closed_loop(url, images, 1, step_s / 2)
    single = summarise("single", "closed", outcomes, None, 1, before, load.gpu_counters(url))
    bill = single["time_bill_ms"]
    infer, total = bill.get("infer", {}).get("p50"), bill.get("total", {}).get("p50")
    if infer and total:
        lines.append(
            f"3. One inference: infer {infer:.0f} ms of {total:.0f} ms total "
            f"({infer / total:.0%} of a lone request is device work)"
        )
    runs, cpu_table = [], {}
    for level in sweep:
        gpu_before = load.gpu_counters(url)
        cpu_before = scope.sample() if scope else None
        outcomes = load.closed_loop(url, images, level, step_s)
        runs.append(summarise("sweep", "closed", outcomes, None, level, gpu_before, load.gpu_counters(url)))
        if cpu_before is not None:
            assert scope is not None
            cpu_table = cpu.ms_per_image(cpu_before, scope.sample(), runs[-1]["succeeded"])
    floor = against_floor(cpu_table, decode_floor_ms(images, load.input_size(url))) if cpu_table.get("stack") else None
    lines.append("4. Concurrency sweep:")
    for r in runs:
        busy = f"{r['gpu_busy']:.0%}" if r["gpu_busy"] is not None else "n/a"
        lines.append(
            f"   c={r['concurrency']:>3}: {r['achieved_qps']:6.2f} QPS, p95 {r['latency_ms']['p95']} ms, "
            f"GPU busy {busy}, mean batch {r['batch_size_mean']}"
        )
    lines.append(f"   pattern: {pattern(runs)}")
    last = runs[-1]
    stages = {k: v["mean"] for k, v in last["time_bill_ms"].items() if k != "total"}
    if stages:
        largest = max(stages, key=lambda stage: stages[stage])
        share = last["time_bill_ms"][largest]["share"]
        lines.append(
            f"5. Time bill at c={last['concurrency']}: largest stage {largest} "
            f"({stages[largest]:.0f} ms mean, {share:.0%} of the total) -> {ADVICE.get(largest, '')}"
        )
    lines.append(f"6. Utilisation band: {band(last['gpu_busy'])}")
    if cpu_table.get("stack"):
        roles = ", ".join(
            f"{role} {ms:.1f}" for role, ms in cpu_table.items() if role not in ("stack", "bench", "stack/bench")
        )
        lines.append(
            f"7. CPU per image at c={last['concurrency']} (this machine's processes): "
            f"{cpu_table['stack']:.1f} ms ({roles}); what a request costs the host"
        )
    if floor:
        lines.append(f"8. Against the decode floor: {describe_floor(floor)} -> {floor_advice(floor)}")
    return "\n".join(lines)


def floor_advice(floor: dict) -> str:
    """What the ratio to the decode floor says about where to look."""
    ratio = floor.get("stack_over_floor") or 0.0
    if ratio <= 1.6:
        return "the stack adds little to decoding itself: scale CPU workers with the images/s you need"
    return (
        "the stack spends more around each image than decoding it: compare the roles above with the floor "
        "(HTTP and Celery in the API and CPU workers, Redis's bytes per image)"
    )


def pattern(runs: list[dict]) -> str:
    """The story's reading of a sweep."""
    first, last = runs[0], runs[-1]
    gain = last["achieved_qps"] / first["achieved_qps"] if first["achieved_qps"] else 0.0
    p95_first, p95_last = first["latency_ms"]["p95"] or 0, last["latency_ms"]["p95"] or 0
    busy_first, busy_last = first["gpu_busy"] or 0.0, last["gpu_busy"] or 0.0
    if gain < 1.3 and p95_last > 3 * max(p95_first, 1):
        if busy_last > busy_first + 0.15:
            return "GPU busy rises but throughput does not: a lock or I/O pattern"
        return (
            "throughput flat, latency grows with concurrency, GPU busy flat: a serial pattern "
            "(requests queue outside the GPU)"
        )
    if gain >= 1.3:
        return (
            f"throughput scales with concurrency (x{gain:.1f} from c={first['concurrency']} to c={last['concurrency']})"
        )
    return "throughput and latency both flat: the load may be too light to tell"


def _rate(url: str) -> str:
    try:
        first = requests.get(f"{url}/v1/stats", timeout=5).json().get("gpu", {}).get("frames_total")
        time.sleep(2.0)
        second = requests.get(f"{url}/v1/stats", timeout=5).json().get("gpu", {}).get("frames_total")
    except (requests.RequestException, ValueError):
        return "unknown (no /v1/stats)"
    if first is None or second is None:
        return "unknown (no GPU counters)"
    rate = (second - first) / 2.0
    return f"{rate:.1f} frames/s reached the GPU before diagnose added load" + (
        "" if rate else " (idle: low utilisation now means nothing)"
    )


def _placement(url: str) -> str:
    try:
        models = requests.get(f"{url}/v1/models", timeout=5).json()["models"]
    except (requests.RequestException, ValueError, KeyError):
        return "unknown (no /v1/models)"
    described = []
    for m in models:
        devices = ", ".join(m.get("devices", []))
        note = (
            " (simulated accelerator)"
            if "sim" in devices
            else (" - NOT on a GPU" if all(not d.startswith("cuda") for d in m.get("devices", [])) else "")
        )
        described.append(f"{m['name']} {m['version']} on {devices}{note}")
    return "; ".join(described) or "no live GPU worker"
