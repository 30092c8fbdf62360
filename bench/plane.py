"""`bench plane`: what the control plane's Redis spends on an image, step by step, and the ceiling that sets.

The product's own processes (the API, a Celery CPU worker with events on, the GPU worker on a simulated device
with no device time) run against a private Redis, and images too small to cost any decode (640x16 JPEGs: a frame
of 8 KB) go through them in phases, so that Redis's own counters (`INFO cpu`'s main thread, `INFO commandstats`)
read before and after each phase say what each step cost:

1. intake: N submissions over HTTP (admission, the result cache's lookup, the upload, the record, the Celery
   message), with no CPU worker running yet;
2. cpu: a CPU worker started: Celery's consume, its ack emulation and events, the claim, the frame's push;
3. gpu: the GPU worker started: its pops, the batches' one write each (the ends, the acks, the PUBLISH that wakes
   long-polls), in full batches, as at the load the ceiling is about;
4. read: each job read once, as a long-poll's wake does (one read of the record).

Each phase is run alone, so idle chatter (heartbeats, sweeps, Celery's BRPOP timeouts) is priced into the phase
it falls in; the report says how much of it there was. HTTP and decode cost the Redis nothing and are left to the
whole-stack view (`bench run --stack local --shards 1`). `--base REF` runs the same phases on another checkout
(a git worktree), one after the other, and prints both.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import requests
import yaml

from bench.plane_meter import InstructionCounter, PhaseCost, PhaseMeter
from bench.processes import (
    REPO_ROOT,
    ManagedProcess,
    RedisServer,
    api_argv,
    cpu_worker_argv,
    free_port,
    gpu_worker_argv,
    wait_until,
)
from bench.stack import api_env

PHASES = ("intake", "cpu", "gpu", "read")


def tiny_jpegs(count: int, seed: int = 1) -> list[bytes]:
    """Distinct 640x16 JPEGs (each a different image: the result cache misses every one)."""
    from PIL import Image

    rng = random.Random(seed)
    images = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.new("RGB", (640, 16), (rng.randrange(256), rng.randrange(256), rng.randrange(256))).save(
            buffer, "JPEG", quality=80
        )
        images.append(buffer.getvalue())
    return images


PLANE_KEY = "plane-key"  # --keyed: the one API key every submission carries


def _config(redis_url: str, shard_urls: list[str], images: int, keyed: bool = False) -> dict[str, Any]:
    room = images + 64
    config: dict[str, Any] = {
        "redis_url": redis_url,
        "gpu_worker": {"device": "sim", "sim_latency_ms": {1: 0.1, 8: 0.1}},
        # every image of a phase waits at once: budgets wide enough for all of them
        "backpressure": {"max_frames": room, "max_backlog": room * 2},
        "auth": {"max_backlog_share": 1.0},
    }
    if shard_urls:
        config["bulk"] = {"redis_urls": shard_urls}
    if keyed:  # as a keyed deployment: the key's own queue and its share of the budgets counted
        digest = hashlib.sha256(PLANE_KEY.encode()).hexdigest()
        config["auth"] = {**config["auth"], "api_keys": [{"id": "plane", "sha256": digest}]}
    return config


def run_phases(
    root: Path, images: int, shards: int, clients: int, workdir: Path, instructions: bool = False, keyed: bool = False
) -> dict[str, Any]:
    """The four phases on the checkout at `root`: per phase and in all, the control plane's cost per image
    (`instructions`: its Redis under callgrind, its instructions counted too; `keyed`: every submission with an
    API key)."""
    workdir.mkdir(parents=True, exist_ok=True)
    counter = InstructionCounter(workdir) if instructions else None
    control = RedisServer(workdir, wrapper=counter.wrapper() if counter else ())
    if counter:
        counter.pid = control.process.pid
    bulk = []
    for index in range(shards):
        folder = workdir / f"shard{index}"
        folder.mkdir(exist_ok=True)
        bulk.append(RedisServer(folder))
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(_config(control.url, [s.url for s in bulk], images, keyed)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "IMGSERVE_CONFIG": str(config_path), "PYTHONUNBUFFERED": "1", **api_env(port, 1, 64)}
    for name in ("IMGSERVE_REDIS_URL", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    processes: list[ManagedProcess] = []
    client = redis.Redis.from_url(control.url)
    bulk_clients = [redis.Redis.from_url(s.url) for s in bulk]
    payloads = tiny_jpegs(images)
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=clients)
    session.mount("http://", adapter)
    meter = PhaseMeter(client, bulk_clients, images, counter)
    measured = meter.measure

    def spawn(name: str, argv: list[str]) -> None:
        processes.append(ManagedProcess(name, argv, env, workdir, root=root))

    try:
        spawn("api", api_argv())
        wait_until(lambda: _answers(url + "/healthz", processes), 60, interval_s=0.2, what="the API")

        def submit(payload: bytes) -> str:
            headers = {"Content-Type": "image/jpeg", **({"Authorization": f"Bearer {PLANE_KEY}"} if keyed else {})}
            reply = session.post(url + "/v1/jobs", data=payload, headers=headers, timeout=30)
            if reply.status_code != 202:
                raise RuntimeError(f"submit answered {reply.status_code}: {reply.text[:300]}")
            return str(reply.json()["id"])

        with ThreadPoolExecutor(clients) as pool:
            ids = measured("intake", lambda: list(pool.map(submit, payloads)))

            def cpu_phase() -> None:
                spawn("cpu-worker", cpu_worker_argv(2))
                waiting = _Progress(bulk_clients or [client], "*:frames:*")
                wait_until(
                    lambda: waiting.frames_waiting() >= images,
                    300,
                    interval_s=0.2,
                    what="every frame pushed",
                )

            measured("cpu", cpu_phase)

            def gpu_phase() -> None:
                spawn("gpu-worker", gpu_worker_argv("sim", "plane-gpu"))
                answered = _Progress([client], "*:gpu:*:counters")
                wait_until(
                    lambda: answered.frames_answered() >= images, 300, interval_s=0.2, what="every frame answered"
                )

            measured("gpu", gpu_phase)

            def read(job_id: str) -> str:
                headers = {"Authorization": f"Bearer {PLANE_KEY}"} if keyed else {}
                return str(session.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()["status"])

            statuses = measured("read", lambda: list(pool.map(read, ids)))
        idle = meter.idle(3.0)
    finally:
        for process in reversed(processes):
            process.stop()
        control.stop()
        for shard in bulk:
            shard.stop()
    ended = {status: statuses.count(status) for status in set(statuses)}
    costs, shard_costs, seconds = meter.net(idle), meter.shard_costs, meter.seconds
    total = _total([costs[phase] for phase in PHASES])
    return {
        "images": images,
        "shards": shards,
        "ended": ended,
        "phases": {phase: costs[phase] for phase in PHASES},
        "shard_phases": shard_costs,
        "seconds": seconds,
        "total": total,
        "idle_per_s": idle,
    }


class _Progress:
    """How far a phase is, looked up cheaply: the keys are found by SCAN once (a SCAN over every record at each
    poll would be priced into the phase), then read by name."""

    def __init__(self, clients: list[redis.Redis], pattern: str) -> None:
        self.clients, self.pattern = clients, pattern
        self.keys: list[tuple[redis.Redis, Any]] = []

    def found(self) -> list[tuple[redis.Redis, Any]]:
        if not self.keys:
            self.keys = [(c, key) for c in self.clients for key in c.scan_iter(match=self.pattern, count=1000)]
        return self.keys

    def frames_waiting(self) -> int:
        return sum(int(c.llen(key)) for c, key in self.found())

    def frames_answered(self) -> int:
        return sum(int(c.hget(key, "frames_total") or 0) for c, key in self.found())


def _total(costs: list[PhaseCost]) -> PhaseCost:
    """The phases' costs added up, command by command."""
    counted = [c.instructions for c in costs if c.instructions is not None]
    total = PhaseCost(
        sum(c.us for c in costs), sum(c.commands for c in costs), instructions=sum(counted) if counted else None
    )
    for cost in costs:
        for name, (calls, us) in cost.by_command.items():
            old_calls, old_us = total.by_command.get(name, (0.0, 0.0))
            total.by_command[name] = (old_calls + calls, old_us + us)
    return total


def _answers(url: str, processes: list[ManagedProcess]) -> bool:
    for process in processes:
        if not process.alive():
            raise RuntimeError(f"{process.name} died:\n{process.log_tail()}")
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def worktree(ref: str, into: Path) -> Path:
    """A checkout of `ref` beside this one (git worktree, detached), for --base."""
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(into), ref], cwd=REPO_ROOT, check=True, capture_output=True
    )
    return into


def report(sides: dict[str, dict[str, Any]]) -> str:
    names = list(sides)
    lines = [
        "## The control plane per image (`bench plane`: Redis's own INFO, phase by phase)",
        "",
        f"{next(iter(sides.values()))['images']} images of 640x16 (no decode cost), "
        f"{next(iter(sides.values()))['shards']} bulk shard(s); µs: the control plane's main-thread CPU; each step "
        "less what the control plane spends idle for as long as the step lasted (the idle row below).",
        "",
        "| step | " + " | ".join(f"{n}: µs | {n}: commands" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for phase in (*PHASES, "total"):
        cells = []
        for side in sides.values():
            cost = side["total"] if phase == "total" else side["phases"][phase]
            cells += [f"{cost.us:.0f}", f"{cost.commands:.1f}"]
        lines.append(f"| {'**all**' if phase == 'total' else phase} | " + " | ".join(cells) + " |")
    if all(side["total"].instructions is not None for side in sides.values()):
        lines += [
            "",
            "Redis's user-space instructions an image (under callgrind: µs above are valgrind's, not the real ones; "
            "the kernel's socket work is not counted):",
            "",
            "| step | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for phase in (*PHASES, "total"):
            counts = [
                (side["total"] if phase == "total" else side["phases"][phase]).instructions for side in sides.values()
            ]
            lines.append(f"| {phase} | " + " | ".join(f"{count:,.0f}" for count in counts if count is not None) + " |")
    lines += ["", "| ceiling | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines.append(
        "| images/s per control-plane core (100%) | "
        + " | ".join(f"{1e6 / s['total'].us:,.0f}" for s in sides.values())
        + " |"
    )
    lines.append(
        "| images/s at 70% of it | " + " | ".join(f"{0.7e6 / s['total'].us:,.0f}" for s in sides.values()) + " |"
    )
    lines.append(
        "| fast GPUs (1,333 images/s) fed at 70% | "
        + " | ".join(f"{0.7e6 / s['total'].us / 1333:.1f}" for s in sides.values())
        + " |"
    )
    if any(s["shard_phases"] for s in sides.values()):
        lines.append(
            "| the shards: µs, commands an image | "
            + " | ".join(
                f"{sum(c.us for c in s['shard_phases'].values()):.0f}, "
                f"{sum(c.commands for c in s['shard_phases'].values()):.1f}"
                for s in sides.values()
            )
            + " |"
        )
    lines.append(
        "| idle (taken out of each step): µs, commands, instructions a second | "
        + " | ".join(
            f"{s['idle_per_s'].us:.0f}, {s['idle_per_s'].commands:.0f}, {s['idle_per_s'].instructions or 0:,.0f}"
            for s in sides.values()
        )
        + " |"
    )
    lines.append("| jobs ended | " + " | ".join(str(s["ended"]) for s in sides.values()) + " |")
    for name, side in sides.items():
        lines += ["", f"**{name}**, per step: command calls (µs in it, a script's including its calls') an image", ""]
        for phase in PHASES:
            top = list(side["phases"][phase].by_command.items())[:12]
            lines.append(
                f"- {phase} ({side['seconds'][phase]:.1f} s): "
                + ", ".join(f"{n} {calls:.2f} ({us:.1f})" for n, (calls, us) in top)
            )
    return "\n".join(lines)


def run(
    images: int, shards: int, clients: int, base: str | None, instructions: bool = False, keyed: bool = False
) -> tuple[str, dict[str, Any]]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-plane-"))
    sides: dict[str, dict[str, Any]] = {}
    try:
        if base:
            root = worktree(base, scratch / "base")
            base_run = scratch / "run-base"
            sides[f"base {base}"] = run_phases(root, images, shards, clients, base_run, instructions, keyed)
        sides["this checkout"] = run_phases(
            REPO_ROOT, images, shards, clients, scratch / "run-head", instructions, keyed
        )
    finally:
        if base:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(scratch / "base")], cwd=REPO_ROOT, capture_output=True
            )
        shutil.rmtree(scratch, ignore_errors=True)
    return report(sides), sides
