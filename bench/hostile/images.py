"""`bench hostile --attack images`: issue 40's decoder attacks against a live local stack, and what a normal tenant saw.

    python -m bench hostile --attack images                  # this checkout
    python -m bench hostile --attack images --base f9d7472   # against a checkout of REF first: before and after

A stack with two API keys (each key's jobs wait on CPU queues of their own) and make run's CPU pool (three
children, replaced past 1 GiB): a normal tenant submits ordinary photos at a steady rate for a quiet phase,
then goes on while the attacker sends every hostile file (bench.hostile.files) `--copies` times at once.
Printed: how each attack's jobs ended and how long after it was sent, the normal tenant's CPU-queue wait
(`timings_ms.queue_cpu`) in each phase, and the CPU children's peak resident memory (sampled) and how many
were replaced.

Attacks that are not image files (issue 40's slow callback receivers) plug in as `more_attacks`: callables
given the stack's URL and the attacker's headers, returning the ids of the jobs they submitted.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import requests

from bench.hostile import files as hostile_files
from bench.load.client import TERMINAL, ImageStream, session_for
from bench.stack.local import LocalStack, StackOptions
from bench.stack.processes import children_of, status_kb
from contract.jobs.timebill import percentile

NORMAL_KEY, ATTACKER_KEY = "bench-normal-tenant-key", "bench-attacker-key"  # a private stack's keys


@dataclass(frozen=True)
class FileAttack:
    name: str
    build: Callable[[], bytes]
    media_type: str


# The files at its sizes (the default upload limit is 20 MiB).
ATTACKS = (
    FileAttack("GIF, 400k comment extensions", hostile_files.gif_comment_bomb, "image/gif"),
    FileAttack("JPEG, EXIF entries over the whole segment", hostile_files.jpeg_exif_bomb, "image/jpeg"),
    FileAttack("PNG, 8 MB eXIf of 250 such entries", hostile_files.png_exif_bomb, "image/png"),
    FileAttack("JPEG, 20 MB of empty COM segments", hostile_files.jpeg_comment_flood, "image/jpeg"),
    FileAttack("PNG, 1.6M empty chunks", hostile_files.png_chunk_flood, "image/png"),
    FileAttack("GIF89a + IM header", hostile_files.gif_im_polyglot, "image/gif"),
)
# Issue 52's: files within the header's limits whose decode held 2-4x the byte cap, or cost CPU by their pixels.
ROUND_FIVE = (
    FileAttack("WebP lossless 8192x8192, one colour", hostile_files.webp_lossless_canvas, "image/webp"),
    FileAttack("WebP animated: 8192x8192 canvas, one 1x1 frame", hostile_files.webp_animated_canvas, "image/webp"),
    FileAttack("BMP RLE8 80,000,000x1: a pixel, end of line", hostile_files.bmp_rle_wide_row, "image/bmp"),
    FileAttack("BMP RLE4 8000x10000 of 255-pixel runs", hostile_files.bmp_rle4_runs, "image/bmp"),
    FileAttack("GIF 8944x8944 screen, one 1x1 frame", hostile_files.gif_big_screen, "image/gif"),
    FileAttack("PNG palette 8944x8944", hostile_files.png_palette, "image/png"),
    FileAttack("JPEG progressive CMYK 8192x8192", hostile_files.jpeg_progressive_cmyk, "image/jpeg"),
    FileAttack("PNG RGBA 8192x8192 (an honest one)", hostile_files.png_rgba, "image/png"),
)
# Issue 59's: PNG text that Pillow held beside the decode's cap (4 bytes a character), read at open.
ROUND_SIX = (
    FileAttack(
        "PNG 1x1, 64 deflated iTXt chunks (1 MiB each, one astral character)", hostile_files.png_text_bomb, "image/png"
    ),
    FileAttack("PNG RGBA 8192x8192 with the same text", hostile_files.png_rgba_text_bomb, "image/png"),
)
ROUNDS = {"four": ATTACKS, "five": ROUND_FIVE, "six": ROUND_SIX, "all": ATTACKS + ROUND_FIVE + ROUND_SIX}
REFUSED = "refused"  # a normal submission not taken: (phase, "refused <status>") among the accepted ids
MoreAttack = Callable[[str, dict[str, str]], list[str]]

# Decode stdin's bytes as a CPU worker does, in a fresh interpreter of a checkout: outcome, CPU s, peak RSS growth.
_DECODE = r"""
import json, sys, time
try:
    from contract.runtime.memory import keep_freed_memory
except ModuleNotFoundError:  # a side that predates contract's packages
    from contract.memory import keep_freed_memory
keep_freed_memory()  # as a CPU worker's malloc is set
try:
    from tasks.decoding.imaging import ImageDecodeError, decode_image
except ModuleNotFoundError:  # a side that predates tasks/'s parts
    from tasks.imaging import ImageDecodeError, decode_image
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
data = sys.stdin.buffer.read()
base, started = hwm(), time.process_time()
try:
    decode_image(data, 640, 80_000_000, 256 * 1024 * 1024)
    outcome = "decoded"
except ImageDecodeError as exc:
    outcome = exc.code
print(json.dumps({"outcome": outcome, "cpu_s": round(time.process_time() - started, 2), "grew_mb": round(hwm() - base),
                  "peak_mb": round(hwm())}))
"""


def decode_each(root: Path, attacks: Sequence[FileAttack]) -> list[dict[str, Any]]:
    """Each file decoded by `root`'s tasks.decoding.imaging as a CPU worker does (target 640, the default limits), in a
    fresh interpreter: how it ended, its CPU seconds and how much the process grew (VmHWM, Pillow's and libwebp's
    own allocations included)."""
    import json
    import os
    import sys

    rows = []
    for attack in attacks:
        data = attack.build()
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run(
            [sys.executable, "-c", _DECODE], input=data, cwd=root, env=env, capture_output=True, timeout=600
        )
        row = json.loads(done.stdout) if done.returncode == 0 else {"outcome": f"crashed ({done.returncode})"}
        rows.append({"attack": attack.name, "bytes": len(data), **row})
    return rows


def decode_markdown(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"### {title}", "", "| file | bytes | outcome | CPU s | grew | peak |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['attack']} | {row['bytes']:,} | {row['outcome']} | {row.get('cpu_s', '-')} | "
            f"+{row.get('grew_mb', '-')} MB | {row.get('peak_mb', '-')} MB |"
        )
    return "\n".join(lines)


@dataclass
class Sent:
    attack: str
    job_id: str | None
    sent_at: float
    status: str = "pending"
    code: str | None = None
    ended_after_s: float | None = None


@dataclass
class MemoryWatch:
    """The CPU worker's children, sampled: the peak resident memory each reached, and who came and went."""

    parent: int
    peak_kb: dict[int, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, interval_s: float = 0.1) -> None:
        while not self.stop.is_set():
            for pid, rss in _children_rss_kb(self.parent).items():
                self.peak_kb[pid] = max(rss, self.peak_kb.get(pid, 0))
            self.stop.wait(interval_s)


def _children_rss_kb(parent: int) -> dict[int, int]:
    found = {child: status_kb(child) for child in children_of(parent)}
    return {child: rss for child, rss in found.items() if rss is not None}


def run_hostile(
    options: StackOptions,
    images: list[bytes],
    qps: float,
    quiet_s: float,
    attack_s: float,
    copies: int,
    attacks: Sequence[FileAttack] = ATTACKS,
    more_attacks: Sequence[MoreAttack] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    keys = [
        {"id": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
        for name, key in (("normal", NORMAL_KEY), ("attacker", ATTACKER_KEY))
    ]
    options = replace(
        options,
        extra={**options.extra, "auth": {"api_keys": keys, "rate_per_s": 0.0}, "cache": {"enabled": False}},
        cpu_worker_args=("--max-memory-per-child=1048576",),
    )  # as make run's Procfile
    built = [(attack, attack.build()) for attack in attacks]
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="hostile-")), options).start()
    try:
        watch = MemoryWatch(stack.process("cpu-worker").process.pid)
        watcher = threading.Thread(target=watch.run, daemon=True)
        watcher.start()
        normal: list[tuple[str, str]] = []  # (phase, job id)
        stop = threading.Event()
        phase = ["quiet"]
        loader = threading.Thread(target=_submit_steadily, args=(stack.url, images, qps, stop, normal, phase))
        loader.start()
        time.sleep(quiet_s)
        quiet_peak = dict(watch.peak_kb)
        phase[0] = "attack"
        log(f"quiet phase over ({len(normal)} jobs); attacking: {len(built)} files x {copies}")
        attack_started = time.monotonic()
        sent = _attack(stack.url, built, copies, more_attacks)
        follower = threading.Thread(target=_follow_hostile, args=(stack.url, sent))  # their end times are a figure
        follower.start()
        time.sleep(max(0.0, attack_started + attack_s - time.monotonic()))
        stop.set()
        loader.join()
        log(f"following {len(normal)} normal and {len(sent)} hostile jobs to their end")
        follower.join()
        tenant = _tenant_waits(stack.url, normal)
        watch.stop.set()
        watcher.join()
    finally:
        stack.stop()
    return {
        "attacks": _tally(sent, {attack.name: len(data) for attack, data in built}),
        "tenant": tenant,
        "memory": _memory(quiet_peak, watch.peak_kb),
        "options": options.describe(),
        "copies": copies,
        "qps": qps,
    }


def _headers(key: str, media_type: str = "image/jpeg") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": media_type}


def _submit_steadily(
    url: str, images: list[bytes], qps: float, stop: threading.Event, accepted: list[tuple[str, str]], phase: list[str]
) -> None:
    session = session_for(4)
    stream = ImageStream(images)
    interval, index, next_at = 1.0 / qps, 0, time.monotonic()
    while not stop.is_set():
        try:
            response = session.post(f"{url}/v1/jobs", data=stream.next(index), headers=_headers(NORMAL_KEY), timeout=30)
            if response.status_code == 202:
                accepted.append((phase[0], response.json()["id"]))
            else:  # counted, not followed (issue 59: the normal tenant's own submissions refused 429)
                accepted.append((phase[0], f"{REFUSED} {response.status_code}"))
        except requests.RequestException:
            pass
        index += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))


def _attack(
    url: str, built: list[tuple[FileAttack, bytes]], copies: int, more_attacks: Sequence[MoreAttack]
) -> list[Sent]:
    """Every file `copies` times, all at once (as the probe sent its three GIFs)."""

    def send(attack: FileAttack, data: bytes) -> Sent:
        sent_at = time.monotonic()
        try:
            response = requests.post(
                f"{url}/v1/jobs", data=data, headers=_headers(ATTACKER_KEY, attack.media_type), timeout=60
            )
        except requests.RequestException as exc:
            return Sent(attack.name, None, sent_at, "error", type(exc).__name__)
        if response.status_code != 202:
            return Sent(
                attack.name, None, sent_at, "refused", f"http_{response.status_code}", time.monotonic() - sent_at
            )
        return Sent(attack.name, response.json()["id"], sent_at)

    with ThreadPoolExecutor(8) as pool:
        sent = list(pool.map(lambda item: send(*item), [item for item in built for _ in range(copies)]))
    for more in more_attacks:
        sent_at = time.monotonic()
        sent += [
            Sent(getattr(more, "__name__", "more"), job_id, sent_at) for job_id in more(url, _headers(ATTACKER_KEY))
        ]
    return sent


def _follow_hostile(url: str, sent: list[Sent], give_up_s: float = 180.0) -> None:
    """Long-poll each hostile job to its end (a thread each: their end times are the figure)."""

    def follow(item: Sent) -> None:
        session = requests.Session()
        while item.job_id and time.monotonic() - item.sent_at < give_up_s:
            try:
                doc = session.get(
                    f"{url}/v1/jobs/{item.job_id}", params={"wait": 10}, headers=_headers(ATTACKER_KEY), timeout=40
                ).json()
            except requests.RequestException:
                continue
            if doc["status"] in TERMINAL:
                item.status, item.code = doc["status"], (doc.get("error") or {}).get("code")
                item.ended_after_s = time.monotonic() - item.sent_at
                return

    with ThreadPoolExecutor(max(1, len(sent))) as pool:
        list(pool.map(follow, [item for item in sent if item.status == "pending"]))


def _tenant_waits(url: str, jobs: list[tuple[str, str]], give_up_s: float = 180.0) -> dict[str, dict[str, Any]]:
    """Each phase's normal jobs: how many, how many succeeded, and their CPU-queue wait (ms)."""
    session = session_for(4)
    deadline = time.monotonic() + give_up_s
    docs: dict[str, dict[str, Any]] = {}
    for _, job_id in jobs:
        while not job_id.startswith(REFUSED) and time.monotonic() < deadline:
            try:
                doc = session.get(
                    f"{url}/v1/jobs/{job_id}", params={"wait": 10}, headers=_headers(NORMAL_KEY), timeout=40
                ).json()
            except requests.RequestException:
                continue
            if doc["status"] in TERMINAL:
                docs[job_id] = doc
                break
    phases: dict[str, dict[str, Any]] = {}
    for phase in ("quiet", "attack"):
        ended = [docs[job_id] for name, job_id in jobs if name == phase and job_id in docs]
        waits = sorted(doc["timings_ms"]["queue_cpu"] for doc in ended if "queue_cpu" in (doc.get("timings_ms") or {}))
        phases[phase] = {
            "jobs": sum(1 for name, job_id in jobs if name == phase and not job_id.startswith(REFUSED)),
            "refused": sum(1 for name, job_id in jobs if name == phase and job_id.startswith(REFUSED)),
            "succeeded": sum(1 for doc in ended if doc["status"] == "succeeded"),
            "queue_cpu_ms": {"p50": percentile(waits, 50), "p95": percentile(waits, 95), "max": max(waits, default=0.0)}
            if waits
            else {},
        }
    return phases


def _tally(sent: list[Sent], sizes: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    for name in dict.fromkeys(item.attack for item in sent):
        items = [item for item in sent if item.attack == name]
        ended = [item.ended_after_s for item in items if item.ended_after_s is not None]
        rows.append(
            {
                "attack": name,
                "bytes": sizes.get(name),
                "jobs": len(items),
                "outcomes": dict(Counter(f"{item.status} {item.code or ''}".strip() for item in items)),
                "ended_after_s_max": max(ended, default=None),
            }
        )
    return rows


def _memory(quiet_kb: dict[int, int], peak_kb: dict[int, int]) -> dict[str, Any]:
    return {
        "quiet_peak_mb": max(quiet_kb.values(), default=0) / 1024,
        "attack_peak_mb": max(peak_kb.values(), default=0) / 1024,
        "children_seen": len(peak_kb),
        "children_at_start": len(quiet_kb),
    }


def markdown(title: str, outcome: dict[str, Any]) -> str:
    lines = [
        f"### {title}",
        "",
        f"{outcome['options']}; normal tenant {outcome['qps']:g} jobs/s; each file sent "
        f"{outcome['copies']} times at once by another key",
        "",
        "| attack | bytes | jobs | ended | last ended after |",
        "|---|---|---|---|---|",
    ]
    for row in outcome["attacks"]:
        ended = ", ".join(f"{k} x{v}" for k, v in row["outcomes"].items())
        after = f"{row['ended_after_s_max']:.2f} s" if row["ended_after_s_max"] is not None else "-"
        lines.append(f"| {row['attack']} | {row['bytes'] or '-'} | {row['jobs']} | {ended} | {after} |")
    lines += ["", "| normal tenant | jobs | refused | succeeded | queue_cpu p50 | p95 | max |", "|" + "---|" * 7]
    for phase, row in outcome["tenant"].items():
        waits = row["queue_cpu_ms"]
        cells = [f"{waits[k]:.0f} ms" for k in ("p50", "p95", "max")] if waits else ["-"] * 3
        cells = [str(row["jobs"]), str(row.get("refused", 0)), str(row["succeeded"]), *cells]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    memory = outcome["memory"]
    lines += [
        "",
        f"CPU children: peak RSS {memory['quiet_peak_mb']:.0f} MB in the quiet phase, "
        f"{memory['attack_peak_mb']:.0f} MB over the run (sampled every 0.1 s); "
        f"{memory['children_seen'] - memory['children_at_start']} replaced or added",
    ]
    return "\n".join(lines)
