"""`bench reads --flood`: issue 70's finding 4 as the probe ran it. A local stack (the API under gunicorn, as the
Procfile runs it, its default two gevent workers; a CPU worker; a GPU worker on the simulated device); a
succeeded job of 1,000 detections (`--detections`) written into its Redis as the GPU worker writes one;
`connections` clients re-reading it as fast as they are answered for `seconds`, while another client submits a
small photo and reads `/healthz` in turn. Its latencies are taken quiet first, then under the flood. `--base REF`
runs the same on a checkout of REF first (under .bench/ab/)."""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
import requests

from bench.load.reads import finished_job, result_document, store_job
from bench.stack.local import LocalStack, StackOptions
from bench.stack.processes import REPO_ROOT


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else (values[0] if values else 0.0)


def probe(url: str, image: bytes, seconds: float) -> dict[str, list[float]]:
    """Another client: a submit, then /healthz, again and again for `seconds`; each one's ms."""
    taken: dict[str, list[float]] = {"submit": [], "healthz": []}
    until = time.monotonic() + seconds
    with requests.Session() as session:
        while time.monotonic() < until:
            started = time.perf_counter()
            session.post(f"{url}/v1/jobs", data=image, headers={"Content-Type": "image/jpeg"}, timeout=30)
            taken["submit"].append((time.perf_counter() - started) * 1000.0)
            started = time.perf_counter()
            session.get(f"{url}/healthz", timeout=30)
            taken["healthz"].append((time.perf_counter() - started) * 1000.0)
            time.sleep(0.1)  # a client at a few requests a second, not a second flood
    return taken


def reread(url: str, until: float, reads: list[int]) -> None:
    with requests.Session() as session:
        while time.monotonic() < until:
            session.get(url, timeout=30)
            reads.append(1)


def run_side(root: Path, connections: int, seconds: float, image: bytes, detections: int) -> dict[str, Any]:
    from contract.jobs.record import new_job_id
    from contract.redis.clock import now as service_now
    from contract.redis.keys import Keys

    with tempfile.TemporaryDirectory(prefix="bench-reads-flood-") as folder:
        stack = LocalStack(Path(folder), StackOptions(root=root)).start()
        try:
            assert stack.redis is not None
            job_id = new_job_id()
            client = redis.Redis.from_url(stack.redis.url)
            store_job(client, Keys("imgserve"), finished_job(job_id, result_document(detections), service_now()))
            job_url = f"{stack.url}/v1/jobs/{job_id}"
            assert requests.get(job_url, timeout=10).status_code == 200
            quiet = probe(stack.url, image, seconds / 3)
            reads: list[int] = []
            until = time.monotonic() + seconds
            flood = [threading.Thread(target=reread, args=(job_url, until, reads)) for _ in range(connections)]
            for thread in flood:
                thread.start()
            loud = probe(stack.url, image, seconds)
            for thread in flood:
                thread.join()
        finally:
            stack.stop()
    return {
        "quiet": {name: p95(values) for name, values in quiet.items()},
        "flood": {name: p95(values) for name, values in loud.items()},
        "reads_per_s": len(reads) / seconds,
    }


def describe_flood(connections: int, seconds: float, base: str | None, detections: int = 1000) -> str:
    from bench.load.ab import worktree

    image = (REPO_ROOT / "samples" / "shapes-3.jpg").read_bytes()
    sides = ([("base " + base, worktree(base))] if base else []) + [("this checkout", REPO_ROOT)]
    lines = [
        f"{connections} connections re-reading a job of {detections} detections for {seconds:g} s; another client's "
        "submit "
        "and /healthz p95 (ms), quiet and under the flood",
        "",
        "| side | reads/s | submit p95 quiet | submit p95 flood | /healthz p95 quiet | /healthz p95 flood |",
        "|---|---|---|---|---|---|",
    ]
    for name, root in sides:
        side = run_side(root, connections, seconds, image, detections)
        quiet, flood = side["quiet"], side["flood"]
        lines.append(
            f"| {name} | {side['reads_per_s']:.0f} | {quiet['submit']:.0f} | {flood['submit']:.0f} | "
            f"{quiet['healthz']:.0f} | {flood['healthz']:.0f} |"
        )
    return "\n".join(lines)
