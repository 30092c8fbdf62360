"""`bench diagnose`: the story's checklist, read off a live deployment first.

It reads and adds no load: `/v1/stats` twice, `read_s` apart (the traffic that reached the GPU, the busy ratio,
the recent time bill), `/v1/models` (where each model runs) and, given `redis_url`, Redis's own counters around
the same seconds (`INFO cpu`'s main thread and `INFO commandstats`, read-only) divided by the images answered
between them. From those: 1. is traffic arriving?  2. is the model on the GPU?  3. what share of a request is
device work?  4. the time bill's largest stage and the runbook's step for it (bench.load.runbook: the same text as
docs/operations.md)  5. the utilisation band  6. what Redis spends an image.

The story's concurrency sweep (1, 8 and 32 clients of 1080p photos) is load: it says what it would add and runs
only with `load=True` (`--load`); the deployment's /v1/stats then counts that load in its recent window.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import Any

import redis
import requests

from bench.load.report import summarise
from bench.load.runbook import band, step_for
from bench.meters.floor import against_floor, decode_floor_ms
from bench.meters.floor import describe as describe_floor
from bench.meters.plane_meter import RedisReading
from bench.stack import cpu
from bench.stack.cpu import CpuScope

MIN_IMAGES = 20  # fewer answered while reading and Redis's CPU an image is mostly its idle chatter
MIN_CPU_S = 0.02  # less CPU than this over the reading is under the counters' resolution
SWEEP = (1, 8, 32)
STEP_S = 10.0


@dataclass(frozen=True)
class Reading:
    """What the deployment said over `seconds`, adding nothing to it."""

    stats: dict[str, Any] | None  # /v1/stats at the end (None: no answer)
    models: list[dict[str, Any]] | None  # /v1/models
    frames: int | None  # frames the GPU workers answered over the reading
    seconds: float
    redis_before: RedisReading | None = None
    redis_after: RedisReading | None = None
    redis_error: str | None = None
    submitted: float | None = None  # jobs the API accepted over the reading (its /metrics), None: unread
    unread: tuple[str, ...] = ()  # what did not answer, and why


def read(url: str, read_s: float = 5.0, redis_url: str | None = None, api_key: str | None = None) -> Reading:
    """Read the deployment for `read_s` seconds: only GETs (with `api_key`, an admin key's) and, given `redis_url`,
    INFO."""
    session = requests.Session()
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    unread: list[str] = []
    first, submitted_first = _get(session, url, "/v1/stats", unread), _submitted(session, url, unread)
    started = time.monotonic()
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0) if redis_url else None
    redis_before = redis_after = None
    redis_error = None
    try:
        redis_before = RedisReading.of(client) if client else None
        time.sleep(read_s)
        redis_after = RedisReading.of(client) if client else None
    except redis.RedisError as exc:
        redis_error = f"{type(exc).__name__}: {exc}"
    last, submitted_last = _get(session, url, "/v1/stats", []), _submitted(session, url, [])
    seconds = time.monotonic() - started
    models = (_get(session, url, "/v1/models", unread) or {}).get("models")
    before, after = _frames(first), _frames(last)
    frames = after - before if before is not None and after is not None and after >= before else None
    submitted = submitted_last - submitted_first if submitted_first is not None and submitted_last is not None else None
    return Reading(
        last, models, frames, seconds, redis_before, redis_after, redis_error, submitted, tuple(dict.fromkeys(unread))
    )


def diagnosis(reading: Reading) -> list[str]:
    """The checklist's lines from what was read."""
    stats = reading.stats or {}
    gpu = stats.get("gpu") or {}
    busy = gpu.get("busy")
    bill = gpu.get("time_bill_ms") or {}
    lines = [f"   not read: {'; '.join(reading.unread)}"] if reading.unread else []
    lines += [f"1. Traffic: {traffic(reading)}", f"2. Model placement: {placement(reading.models)}"]
    infer, total = (bill.get("infer") or {}).get("p50"), (bill.get("total") or {}).get("p50")
    if infer and total:
        outside = " (the bottleneck is outside the GPU)" if infer / total < 0.2 else ""
        lines.append(
            f"3. Device share: infer {infer:.0f} ms of {total:.0f} ms total at p50 "
            f"({infer / total:.0%} of a request is device work){outside}"
        )
    else:
        why = "no job answered in the recent window" if reading.stats else "no /v1/stats"
        lines.append(f"3. Device share: unknown ({why})")
    stages = {name: float(value["mean"]) for name, value in bill.items() if name != "total" and "mean" in value}
    if stages and max(stages.values()) > 0:
        largest = max(stages, key=lambda name: stages[name])
        p95 = (bill.get("total") or {}).get("p95")
        lines.append(
            f"4. Time bill (recent window, p95 {p95:.0f} ms): largest stage {largest} "
            f"({stages[largest]:.0f} ms mean, {bill[largest].get('share', 0):.0%} of the total)"
        )
        lines.append(f"   -> {step_for(largest, busy).plain()}")
    else:
        lines.append("4. Time bill: no job answered in the recent window")
    busy_text = f"{busy:.0%} busy: " if busy is not None else ""
    lines.append(f"5. Utilisation band: {busy_text}{band(busy)}")
    lines.append(f"6. Redis: {redis_cost(reading)}")
    return lines


def traffic(reading: Reading) -> str:
    seconds = max(reading.seconds, 1e-9)
    accepted = (
        f"{reading.submitted / seconds:.1f} jobs/s accepted (the API's imgserve_api_jobs_submitted_total); "
        if reading.submitted is not None
        else ""
    )
    if reading.frames is None:
        return accepted + "frames reaching the GPU unknown (no GPU counters in /v1/stats)"
    rate = reading.frames / seconds
    text = f"{rate:.1f} frames/s reached the GPU over {reading.seconds:.0f} s ({reading.frames} frames)"
    return accepted + text + ("" if reading.frames else " (idle: a low busy ratio now means nothing)")


def redis_cost(reading: Reading) -> str:
    """Redis's main-thread CPU an image, from its own counters over the images answered; "unknown" and why when
    that cannot be divided honestly, never a zero."""
    before, after = reading.redis_before, reading.redis_after
    if reading.redis_error:
        return f"unknown (INFO failed: {reading.redis_error})"
    if before is None or after is None:
        return "unknown (give --redis-url to read Redis's own counters: INFO, read-only)"
    return cost_between(before, after, reading.frames or 0, f"over {reading.seconds:.0f} s of the live traffic")


def cost_between(before: RedisReading, after: RedisReading, images: int, over: str) -> str:
    cpu_s = after.cpu_s - before.cpu_s
    if images < MIN_IMAGES:
        return f"unknown ({images} images answered {over}: too few to divide Redis's CPU by)"
    if cpu_s < MIN_CPU_S:
        return f"unknown (Redis's main thread counted {cpu_s * 1000:.0f} ms of CPU {over}: under its resolution)"
    us = cpu_s * 1e6 / images
    command_us = sum(after.usec.get(name, 0) - before.usec.get(name, 0) for name in after.usec) / images
    return (
        f"{us:,.0f} µs of its main thread an image (INFO cpu, {images} images {over}; {command_us:,.0f} µs "
        f"inside commands, INFO commandstats): one Redis core carries about {1e6 / us:,.0f} images/s at 100%, "
        f"{0.7e6 / us:,.0f} planning at 70%"
    )


def placement(models: list[dict[str, Any]] | None) -> str:
    if models is None:
        return "unknown (no /v1/models)"
    described = []
    for m in models:
        devices = m.get("devices", [])
        note = (
            " (simulated accelerator)"
            if "sim" in devices
            else (" - NOT on a GPU" if all(not d.startswith("cuda") for d in devices) else "")
        )
        described.append(f"{m['name']} {m['version']} on {', '.join(devices)}{note}")
    return "; ".join(described) or "no live GPU worker"


def planned_load(images: list[bytes], sweep: tuple[int, ...], step_s: float, p50_ms: float | None) -> str:
    """What `--load` would add, said before it adds it."""
    seconds = step_s / 2 + step_s * len(sweep)
    size = _image_size(images[0]) if images else "no"
    mean_kb = sum(len(i) for i in images) / len(images) / 1024 if images else 0.0
    expected = (
        f"about {round((step_s / 2 + step_s * sum(sweep)) * 1000.0 / p50_ms):,} requests if each took today's p50 of "
        f"{p50_ms:.0f} ms (fewer where they queue)"
        if p50_ms
        else "as many requests as it answers (no p50 to estimate from)"
    )
    clients = f"{', '.join(map(str, sweep))} client{'s' if max(sweep, default=1) > 1 else ''}"
    return (
        f"--load would add a closed loop of 1 client for {step_s / 2:g} s, then {clients} for {step_s:g} s each "
        f"({seconds:g} s in all) of {len(images)} {size} images ({mean_kb:.0f} KB mean): {expected}; /v1/stats's "
        "p95 and time bill would then count that load as the deployment's"
    )


def diagnose(
    url: str,
    images: list[bytes],
    sweep: tuple[int, ...] = SWEEP,
    step_s: float = STEP_S,
    scope: CpuScope | None = CpuScope(),
    load: bool = False,
    redis_url: str | None = None,
    read_s: float = 5.0,
    api_key: str | None = None,
) -> str:
    """The checklist from reads alone; with `load`, the story's concurrency sweep after it."""
    reading = read(url, read_s, redis_url, api_key)
    lines = [f"# diagnose {url}: what it says over {reading.seconds:.0f} s of reading", "", *diagnosis(reading)]
    p50 = (((reading.stats or {}).get("gpu") or {}).get("time_bill_ms") or {}).get("total", {}).get("p50")
    plan = planned_load(images, sweep, step_s, p50)
    if not load:
        return "\n".join([*lines, "", f"Load: none added. {plan}."])
    lines += ["", f"# the sweep (--load): {plan.removeprefix('--load would add ')}"]
    return "\n".join(lines + sweep_lines(url, images, sweep, step_s, scope, redis_url))


def sweep_lines(
    url: str, images: list[bytes], sweep: tuple[int, ...], step_s: float, scope: CpuScope | None, redis_url: str | None
) -> list[str]:
    """The story's concurrency sweep: load, and what it showed."""
    from bench.load import client as loader

    client = redis.Redis.from_url(redis_url, socket_timeout=5.0) if redis_url else None
    lines = []
    before = loader.gpu_counters(url)
    outcomes = loader.closed_loop(url, images, 1, step_s / 2)
    single = summarise("single", "closed", outcomes, None, 1, before, loader.gpu_counters(url))
    bill = single["time_bill_ms"]
    infer, total = bill.get("infer", {}).get("p50"), bill.get("total", {}).get("p50")
    if infer and total:
        lines.append(f"L1. One client: infer {infer:.0f} ms of {total:.0f} ms total ({infer / total:.0%} device work)")
    runs, cpu_table = [], {}
    redis_before = RedisReading.of(client) if client else None
    for level in sweep:
        gpu_before = loader.gpu_counters(url)
        cpu_before = scope.sample() if scope else None
        outcomes = loader.closed_loop(url, images, level, step_s)
        runs.append(summarise("sweep", "closed", outcomes, None, level, gpu_before, loader.gpu_counters(url)))
        if cpu_before is not None and scope is not None:
            cpu_table = cpu.ms_per_image(cpu_before, scope.sample(), runs[-1]["succeeded"])
    lines.append("L2. Concurrency sweep:")
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
        lines.append(f"L3. Time bill at c={last['concurrency']}: largest stage {largest}")
        lines.append(f"   -> {step_for(largest, last['gpu_busy']).plain()}")
    succeeded = sum(r["succeeded"] for r in runs)
    if redis_before is not None and client is not None:
        over = f"over the sweep's {len(runs)} steps"
        lines.append(f"L4. Redis: {cost_between(redis_before, RedisReading.of(client), succeeded, over)}")
    else:
        lines.append("L4. Redis: unknown (give --redis-url to read Redis's own counters)")
    # this machine's processes by /proc; Redis's share is left to its own counters above (a Redis found here by
    # its port may not be the deployment's)
    roles = {k: v for k, v in cpu_table.items() if not k.startswith("redis") and k not in ("stack", "stack/bench")}
    roles["stack"] = round(sum(v for k, v in roles.items() if k != "bench"), 2)
    if roles["stack"]:
        floor = against_floor(roles, decode_floor_ms(images, loader.input_size(url)))
        named = ", ".join(f"{role} {ms:.1f}" for role, ms in roles.items() if role not in ("stack", "bench"))
        lines.append(f"L5. CPU ms an image of this machine's processes at c={last['concurrency']}: {named}")
        lines.append(f"L6. Against the decode floor: {describe_floor(floor)} -> {floor_advice(floor)}")
    return lines


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


def _get(session: requests.Session, url: str, path: str, unread: list[str]) -> dict[str, Any] | None:
    try:
        answer = session.get(f"{url}{path}", timeout=5)
        document = answer.json() if answer.ok else None
    except (requests.RequestException, ValueError) as exc:
        unread.append(f"{path}: {type(exc).__name__}")
        return None
    if answer.status_code in (401, 403):
        unread.append(f"{path}: {answer.status_code}, it needs an admin key (--api-key or IMGSERVE_API_KEY)")
    elif not answer.ok:
        unread.append(f"{path}: {answer.status_code}")
    return document if isinstance(document, dict) else None


def _submitted(session: requests.Session, url: str, unread: list[str]) -> float | None:
    """The jobs the API has accepted so far, by its /metrics (None where it is served elsewhere: api.metrics_port)."""
    try:
        answer = session.get(f"{url}/metrics", timeout=5)
    except requests.RequestException as exc:
        unread.append(f"/metrics: {type(exc).__name__}")
        return None
    if not answer.ok:
        unread.append(f"/metrics: {answer.status_code} (with api.metrics_port it is served on that port only)")
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in answer.text.splitlines()
        if line.startswith("imgserve_api_jobs_submitted_total{")
    ]
    return sum(values)


def _frames(stats: dict[str, Any] | None) -> int | None:
    value = ((stats or {}).get("gpu") or {}).get("frames_total")
    return int(value) if isinstance(value, int | float) else None


def _image_size(data: bytes) -> str:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return f"{image.width}x{image.height} {image.format}"
    except OSError:
        return "unreadable"
