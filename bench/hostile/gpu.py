"""`bench hostile --attack gpu-flood`: issue 70's finding 2. One key floods distinct 1x1 PNGs (`cache=false`,
`--attackers` threads, each refusal sent again at once) while another key sends a photo every 0.5 s, on a device
slow enough to be the bottleneck (the sim device's story profile by default). In three phases: the photo key alone,
the flooding key alone, then both. It prints the photo key's latency (its jobs' time bill: `total`, and the GPU
side's `queue_gpu` and `device_queue`) alone and beside the flood, and the flooding key's accepted and answered
images a second alone and beside the photos (a key alone must keep the whole GPU)."""

from __future__ import annotations

import io
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import redis
import requests

from bench.hostile.attacks import keyed_stack_options
from bench.stack.local import LocalStack, StackOptions
from contract.redis.keys import Keys

EVERY_S = 0.5  # the photo key's pace
STAGES = ("queue_cpu", "decode", "backpressure", "queue_gpu", "batch_wait", "device_queue", "infer")


def tiny_png(number: int) -> bytes:
    """A 1x1 PNG of its own colour (and a text chunk past 2^24): every one a distinct image."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("n", str(number))
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1), (number & 255, (number >> 8) & 255, (number >> 16) & 255)).save(
        buffer, "PNG", pnginfo=info
    )
    return buffer.getvalue()


class Flood:
    """`threads` threads of one key posting tiny PNGs until stopped, counted by status per phase."""

    def __init__(self, url: str, key: str, threads: int) -> None:
        self.url, self.key = url, key
        self.codes: Counter[int] = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.sent = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def start(self) -> Flood:
        for thread in self.threads:
            thread.start()
        return self

    def counts(self) -> Counter[int]:
        with self.lock:
            return Counter(self.codes)

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _run(self, index: int) -> None:
        session = requests.Session()
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "image/png"}
        number = index << 24
        while not self.stop.is_set():
            number += 1
            try:
                response = session.post(
                    f"{self.url}/v1/jobs", params={"cache": "false"}, data=tiny_png(number), headers=headers, timeout=60
                )
                code = response.status_code
            except requests.RequestException:
                code = 0
            with self.lock:
                self.codes[code] += 1


def answered(client: redis.Redis, keys: Keys) -> int:
    """Frames every GPU worker answered so far (their counters)."""
    workers = [bytes(raw).decode() for raw in cast(list[bytes], client.zrange(keys.gpu_workers, 0, -1))]
    return sum(int(float(client.hget(keys.gpu_counters(worker), "frames_total") or 0)) for worker in workers)


def photos(url: str, key: str, images: list[bytes], seconds: float) -> list[str]:
    """One photo every EVERY_S for `seconds` (`cache=false`: the corpus repeats): the accepted jobs' ids."""
    session = requests.Session()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "image/jpeg"}
    accepted, started, index = [], time.monotonic(), 0
    while time.monotonic() - started < seconds:
        response = session.post(
            f"{url}/v1/jobs", params={"cache": "false"}, data=images[index % len(images)], headers=headers, timeout=60
        )
        if response.status_code == 202:
            accepted.append(str(response.json()["id"]))
        index += 1
        time.sleep(max(0.0, started + index * EVERY_S - time.monotonic()))
    return accepted


def bills(url: str, key: str, job_ids: list[str]) -> dict[str, Any]:
    """The jobs' ends and their time bills' quantiles (ms)."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    docs = [session.get(f"{url}/v1/jobs/{job_id}", params={"wait": 30}, timeout=60).json() for job_id in job_ids]
    done = [doc["timings_ms"] for doc in docs if doc.get("status") == "succeeded"]

    def pick(stage: str, q: float) -> float | None:
        from contract.jobs.timebill import percentile

        values = sorted(float(bill.get(stage, 0.0)) for bill in done)
        return round(percentile(values, q), 1) if values else None

    return {
        "n": len(job_ids),
        "statuses": dict(Counter(str(doc.get("status")) for doc in docs)),
        "total_ms": {"p50": pick("total", 50), "p95": pick("total", 95)},
        "queue_gpu_p50_ms": pick("queue_gpu", 50),
        "device_queue_p50_ms": pick("device_queue", 50),
        "p50_ms_by_stage": {stage: pick(stage, 50) for stage in STAGES},
    }


def rates(before: tuple[Counter[int], int], after: tuple[Counter[int], int], seconds: float) -> dict[str, Any]:
    """The flood's accepted, refused and answered images a second between two looks (codes, frames answered)."""
    codes = after[0] - before[0]
    return {
        "accepted_per_s": round(codes[202] / seconds, 1),
        "refused_per_s": round(sum(n for code, n in codes.items() if code != 202) / seconds, 1),
        "answered_per_s": round((after[1] - before[1]) / seconds, 1),
    }


def gpu_flood(
    options: StackOptions,
    images: list[bytes],
    attackers: int = 6,
    duration_s: float = 40.0,
    log: Any = print,
    **_ignored: Any,
) -> dict[str, Any]:
    """The photo key alone (20 photos), the flood alone for half of `duration_s`, then both for `duration_s` (the
    photos' first 5 s left out: the flood fills the list first)."""
    workdir = Path(tempfile.mkdtemp(prefix="hostile-gpu-"))
    options, keys = keyed_stack_options(options, workdir, callback_worker=False)
    stack = LocalStack(workdir, options).start()
    assert stack.redis is not None
    control, names = redis.Redis.from_url(stack.redis.url), Keys()
    try:
        alone = bills(stack.url, keys["tenant"], photos(stack.url, keys["tenant"], images, 20 * EVERY_S))
        log(f"the photo key alone: {alone}")
        flood = Flood(stack.url, keys["attacker"], attackers).start()
        time.sleep(5.0)  # the flood fills the list and reaches its pace
        look = (flood.counts(), answered(control, names))
        time.sleep(duration_s / 2)
        now = (flood.counts(), answered(control, names))
        flood_alone, look = rates(look, now, duration_s / 2), now
        log(f"the flood alone: {flood_alone}")
        started = time.monotonic()
        beside_ids = photos(stack.url, keys["tenant"], images, duration_s)
        flood_beside = rates(look, (flood.counts(), answered(control, names)), time.monotonic() - started)
        flood.join()
        beside = bills(stack.url, keys["tenant"], beside_ids[int(5 / EVERY_S) :])
    finally:
        stack.stop()
    return {
        "attackers": attackers,
        "duration_s": duration_s,
        "photos_alone": alone,
        "photos_beside_flood": beside,
        "flood_alone": flood_alone,
        "flood_beside_photos": flood_beside,
        "flood_codes": {str(code): n for code, n in sorted(flood.counts().items())},
    }


def format_gpu_flood(outcome: dict[str, Any]) -> str:
    alone, beside = outcome["photos_alone"], outcome["photos_beside_flood"]
    lone, shared = outcome["flood_alone"], outcome["flood_beside_photos"]
    return "\n".join(
        [
            f"gpu-flood: one key's 1x1 PNGs (cache=false) from {outcome['attackers']} threads, another key's photo "
            f"every {EVERY_S:g} s; the flood's answers {outcome['flood_codes']}",
            f"  photos alone: p50 {alone['total_ms']['p50']} ms, p95 {alone['total_ms']['p95']} ms "
            f"({alone['statuses']})",
            f"  photos beside the flood: p50 {beside['total_ms']['p50']} ms, p95 {beside['total_ms']['p95']} ms; "
            f"queue_gpu p50 {beside['queue_gpu_p50_ms']} ms, device_queue p50 {beside['device_queue_p50_ms']} ms "
            f"({beside['statuses']}); p50 by stage {beside['p50_ms_by_stage']}",
            f"  the flood alone: {lone['accepted_per_s']} accepted/s, {lone['answered_per_s']} answered/s "
            f"({lone['refused_per_s']} refused/s)",
            f"  the flood beside the photos: {shared['accepted_per_s']} accepted/s, {shared['answered_per_s']} "
            f"answered/s, the photos' among them ({shared['refused_per_s']} refused/s)",
        ]
    )
