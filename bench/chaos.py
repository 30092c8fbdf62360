"""`bench chaos`: a steady load while GPU workers, a Celery child and Redis are
killed and brought back; then every accepted job is followed to its end.

Prints accepted, succeeded, failed by reason, expired, lost (must be 0) and
duplicated (must be 0: a job whose answer changed after it was first read).
Redis runs with an append-only file fsynced on every write, as a deployment
that must lose nothing would.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests

from bench.load import TERMINAL, ImageStream, session_for
from bench.processes import children_of
from bench.stack import LocalStack, StackOptions


def run_chaos(options: StackOptions, images: list[bytes], qps: float, duration_s: float, log=print) -> dict[str, Any]:
    options.persistent_redis = True
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="chaos-")), options).start()
    accepted: list[str] = []
    refused: Counter[str] = Counter()
    stop = threading.Event()
    try:
        loader = threading.Thread(target=_submit_steadily, args=(stack.url, images, qps, stop, accepted, refused))
        loader.start()
        _misbehave(stack, duration_s, log)
        stop.set()
        loader.join()
        log(f"load stopped; following {len(accepted)} accepted jobs to their end")
        tally = _follow(stack.url, accepted)
    finally:
        stack.stop()
    return {"accepted": len(accepted), "refused": dict(refused), **tally}


def _submit_steadily(
    url: str, images: list[bytes], qps: float, stop: threading.Event, accepted: list[str], refused: Counter
) -> None:
    session = session_for(8)
    stream = ImageStream(images)  # every image new: the jobs are computed, not answered from the result cache
    interval, i = 1.0 / qps, 0
    next_at = time.monotonic()
    while not stop.is_set():
        try:
            response = session.post(
                f"{url}/v1/jobs", data=stream.next(i), headers={"Content-Type": "image/jpeg"}, timeout=10
            )
            if response.status_code == 202:
                accepted.append(response.json()["id"])
            else:
                refused[f"http_{response.status_code}"] += 1
        except requests.RequestException as exc:
            refused[type(exc).__name__] += 1
        i += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))


def _misbehave(stack: LocalStack, duration_s: float, log) -> None:
    """Kill the GPU worker twice, a Celery child once, and stop Redis once, spread over the run."""
    started = time.monotonic()

    def at(fraction: float) -> None:
        time.sleep(max(0.0, started + duration_s * fraction - time.monotonic()))

    at(0.15)
    _kill_and_restart(stack, "gpu-worker", log)
    at(0.35)
    children = sorted(children_of(stack.process("cpu-worker").process.pid))
    if children:
        os.kill(children[0], signal.SIGKILL)
        log(f"SIGKILL celery child {children[0]}")
    at(0.55)
    _kill_and_restart(stack, "gpu-worker", log)
    at(0.7)
    log("stopping redis for 3 s")
    assert stack.redis is not None
    stack.redis.stop()
    time.sleep(3.0)
    stack.redis.start()
    log("redis is back")
    at(1.0)


def _kill_and_restart(stack: LocalStack, name: str, log) -> None:
    stack.process(name).stop(signal.SIGKILL)
    log(f"SIGKILL {name}")
    time.sleep(1.0)
    stack.restart(name)
    log(f"restarted {name}")


def _follow(url: str, ids: list[str], give_up_s: float = 180.0) -> dict[str, Any]:
    session = session_for(8)
    deadline = time.monotonic() + give_up_s
    final: dict[str, dict] = {}
    pending = list(ids)
    while pending and time.monotonic() < deadline:
        still = []
        for job_id in pending:
            doc = _read(session, url, job_id)
            if doc is not None and doc["status"] in TERMINAL:
                final[job_id] = doc
            else:
                still.append(job_id)
        pending = still
        if pending:
            time.sleep(0.5)
    time.sleep(1.0)
    duplicated = sum(
        1 for job_id, doc in final.items() if (_read(session, url, job_id) or {}).get("batch") != doc.get("batch")
    )
    statuses = Counter(doc["status"] for doc in final.values())
    failed = Counter((doc.get("error") or {}).get("code") for doc in final.values() if doc["status"] == "failed")
    return {
        "succeeded": statuses["succeeded"],
        "failed": dict(failed),
        "expired": statuses["expired"],
        "cancelled": statuses["cancelled"],
        "lost": len(pending),
        "duplicated": duplicated,
    }


def _read(session: requests.Session, url: str, job_id: str) -> dict | None:
    try:
        response = session.get(f"{url}/v1/jobs/{job_id}", timeout=10)
    except requests.RequestException:
        return None
    return response.json() if response.status_code == 200 else None


def format_tally(tally: dict[str, Any]) -> str:
    failed = ", ".join(f"{k} x{v}" for k, v in tally["failed"].items()) or "none"
    refused = ", ".join(f"{k} x{v}" for k, v in tally["refused"].items()) or "none"
    return "\n".join(
        [
            "| accepted | succeeded | failed | expired | lost | duplicated |",
            "|---|---|---|---|---|---|",
            f"| {tally['accepted']} | {tally['succeeded']} | {sum(tally['failed'].values())} | {tally['expired']} | "
            f"{tally['lost']} | {tally['duplicated']} |",
            "",
            f"failed by reason: {failed}; refused at submit (not accepted): {refused}",
        ]
    )
