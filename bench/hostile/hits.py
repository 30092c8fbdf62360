"""`python -m bench.hostile.hits`: issue 70's cache-hit flood, against a live local stack on a Redis of its own with
a maxmemory and noeviction (as `make run` sets one), and what another key saw meanwhile.

One key runs one job on a busy photo with conf=0&iou=1&max_det=1000 (the default model, on the CPU: 1,000
detections), then resubmits the same bytes and options from `--connections` connections for `--duration` s.
Every second another key submits an image of its own. It prints the flood's answers by status and their rate,
Redis's used memory (before, its peak, after) against `backpressure.store_full_ratio` of its maxmemory, the job
records stored, and the other key's answers by status (during the flood, and once more after it).

`--root` runs the stack from another checkout (the figures before a change); `--hit-bytes` sets
`jobs.answer_bytes_per_key` (a checkout that has it; `cache.hit_bytes_per_key` before it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis
import requests

from bench.hostile.attacks import keyed_stack_options
from bench.stack.local import LocalStack, StackOptions
from bench.stack.processes import REPO_ROOT

BUSY = {"conf": "0", "iou": "1", "max_det": "1000"}


def flood(stack: LocalStack, keys: dict[str, str], connections: int, duration_s: float) -> dict[str, Any]:
    assert stack.redis is not None
    control = redis.Redis.from_url(stack.redis.url)
    photo = (REPO_ROOT / "samples" / "board.jpg").read_bytes()
    others = [(REPO_ROOT / "samples" / name).read_bytes() for name in ("shapes-3.jpg", "shapes-36.jpg")]

    def submit(key: str, body: bytes, params: dict[str, str]) -> requests.Response:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "image/jpeg"}
        return requests.post(f"{stack.url}/v1/jobs", params=params, data=body, headers=headers, timeout=60)

    first = submit(keys["attacker"], photo, {**BUSY, "wait": "30"})
    first.raise_for_status()
    answer = first.json()
    memory = control.info("memory")
    maxmemory, before = int(memory["maxmemory"]), int(memory["used_memory"])
    codes: Counter[int] = Counter()
    other: list[tuple[float, int, str]] = []
    peak = [before]
    ends = time.monotonic() + duration_s
    started = time.monotonic()

    def attacker() -> None:
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {keys['attacker']}"
        while time.monotonic() < ends:
            response = session.post(
                f"{stack.url}/v1/jobs", params=BUSY, data=photo, headers={"Content-Type": "image/jpeg"}, timeout=60
            )
            codes[response.status_code] += 1

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(connections)]
    for thread in threads:
        thread.start()
    while time.monotonic() < ends:
        response = submit(keys["tenant"], others[len(other) % 2], {})
        other.append((round(time.monotonic() - started, 1), response.status_code, _problem_type(response)))
        peak.append(int(control.info("memory")["used_memory"]))
        time.sleep(1.0)
    for thread in threads:
        thread.join()
    after_flood = submit(keys["tenant"], others[0], {})
    return {
        "answer_bytes": len(json.dumps(answer.get("result"), separators=(",", ":"))),
        "detections": len((answer.get("result") or {}).get("detections", [])),
        "flood": {str(code): count for code, count in sorted(codes.items())},
        "flood_per_s": round(sum(codes.values()) / duration_s, 1),
        "maxmemory_mb": round(maxmemory / 2**20, 1),
        "used_mb": {
            "before": round(before / 2**20, 1),
            "peak": round(max(peak) / 2**20, 1),
            "after": round(int(control.info("memory")["used_memory"]) / 2**20, 1),
        },
        "job_records": sum(1 for _ in control.scan_iter(match="*:job:*", count=1000) if not _.endswith(b":upload")),
        "other_key": dict(Counter(f"{status} {kind}".strip() for _, status, kind in other)),
        "other_key_first_refused_at_s": next((at for at, status, _ in other if status != 202), None),
        "other_key_after": f"{after_flood.status_code} {_problem_type(after_flood)}".strip(),
    }


def _problem_type(response: requests.Response) -> str:
    if response.headers.get("Content-Type") != "application/problem+json":
        return ""
    return str(response.json().get("type", "")).removeprefix("/problems/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds the flood lasts")
    parser.add_argument("--maxmemory-mb", type=int, default=256, help="the stack's Redis (noeviction)")
    parser.add_argument("--hit-bytes", type=int, default=None, help="jobs.answer_bytes_per_key (default: the config's)")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="the checkout the stack runs from")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hostile-hits-") as workdir:
        options = StackOptions(
            device="cpu",
            cpu_workers=1,
            root=args.root.resolve(),
            redis_args=("--maxmemory", f"{args.maxmemory_mb}mb", "--maxmemory-policy", "noeviction"),
        )
        if args.hit_bytes is not None:
            options.extra = {"jobs": {"answer_bytes_per_key": args.hit_bytes}}
        options, keys = keyed_stack_options(options, Path(workdir), callback_worker=False)
        stack = LocalStack(Path(workdir) / "stack", options).start()
        try:
            print(json.dumps(flood(stack, keys, args.connections, args.duration)), flush=True)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
