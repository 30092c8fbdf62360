"""`bench chaos --scenario failover`: make run's stack behind Sentinel (tools.redis_ha), a steady load, and the
primary SIGKILLed under it; later the killed server comes back (as a replica). Every 202 is followed to its end.

Prints: the seconds from the kill to the first 202 after it, what the submissions met meanwhile, every accepted
job's end (succeeded, failed by reason, expired: each expired job's deadline against the outage), lost (a 404 on
a job that got a 202: must be 0), answers that changed after a client read them (status or result), jobs done
twice (read ended, then ended again by another batch), and whether any process was restarted (none may be).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench.load import TERMINAL, ImageStream, session_for
from bench.stack import ProcfileStack, StackOptions


@dataclass
class Followed:
    """One accepted job as its client saw it."""

    job_id: str
    submitted: float  # monotonic
    deadline_at: float  # monotonic, from its deadline_ms
    first_end: dict[str, Any] | None = None
    read_at: float = 0.0
    missing: int = 0  # reads that answered 404


@dataclass
class FailoverRun:
    accepted: list[Followed] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    first_202_after_kill_s: float | None = None
    killed_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_failover(
    options: StackOptions,
    images: list[bytes],
    qps: float = 20.0,
    duration_s: float = 40.0,
    kill_at_s: float = 10.0,
    back_after_s: float = 10.0,
    deadline_ms: int = 60_000,
    log=print,
) -> dict[str, Any]:
    """The scenario on a fresh stack; the tally (see the module's note)."""
    options.sentinel = True
    stack = ProcfileStack(Path(tempfile.mkdtemp(prefix="failover-")), options).start()
    assert stack.ha is not None
    run = FailoverRun()
    stop = threading.Event()
    followers = ThreadPoolExecutor(128)
    try:
        loader = threading.Thread(target=_submit, args=(stack.url, images, qps, deadline_ms, stop, run, followers))
        loader.start()
        time.sleep(kill_at_s)
        killed = stack.ha.kill_primary()
        run.killed_at = time.monotonic()
        log(f"SIGKILL the primary ({killed}); the Sentinels will promote the replica")
        promoted = stack.ha.wait_settled(60)
        log(f"the Sentinels name {promoted} the primary, {time.monotonic() - run.killed_at:.1f} s after the kill")
        time.sleep(max(0.0, run.killed_at + back_after_s - time.monotonic()))
        stack.ha.restart(killed)
        log(f"{killed} is back; the Sentinels make it a replica of {promoted}")
        time.sleep(max(0.0, run.killed_at - kill_at_s + duration_s - time.monotonic()))
        stop.set()
        loader.join()
        followers.shutdown(wait=True)
        log(f"load stopped; {len(run.accepted)} accepted jobs followed to their end; reading each again")
        role = stack.ha.role(killed)
        tally = _tally(stack, run)
        tally["killed_comes_back_as"] = role
    finally:
        stop.set()
        followers.shutdown(wait=False, cancel_futures=True)
        stack.stop()
    return tally


def _submit(
    url: str,
    images: list[bytes],
    qps: float,
    deadline_ms: int,
    stop: threading.Event,
    run: FailoverRun,
    followers: ThreadPoolExecutor,
) -> None:
    session = session_for(16)
    stream = ImageStream(images)  # every image new: computed, not answered from the result cache
    interval, i, next_at = 1.0 / qps, 0, time.monotonic()
    while not stop.is_set():
        started = time.monotonic()
        try:
            response = session.post(
                f"{url}/v1/jobs",
                data=stream.next(i),
                params={"deadline_ms": deadline_ms},
                headers={"Content-Type": "image/jpeg"},
                timeout=15,
            )
            if response.status_code == 202:
                job = Followed(response.json()["id"], started, started + deadline_ms / 1000.0)
                with run.lock:
                    run.accepted.append(job)
                    if run.killed_at is not None and run.first_202_after_kill_s is None and started > run.killed_at:
                        run.first_202_after_kill_s = time.monotonic() - run.killed_at
                followers.submit(_follow, url, job)
            else:
                problem = (
                    response.json().get("type", "") if response.headers.get("Content-Type", "").endswith("json") else ""
                )
                run.refused[f"{response.status_code} {problem.rsplit('/', 1)[-1]}".strip()] += 1
        except requests.RequestException as exc:
            run.refused[type(exc).__name__] += 1
        i += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))


def _follow(url: str, job: Followed, give_up_s: float = 180.0) -> None:
    session = requests.Session()
    until = time.monotonic() + give_up_s
    while time.monotonic() < until:
        try:
            response = session.get(f"{url}/v1/jobs/{job.job_id}", params={"wait": 10}, timeout=30)
        except requests.RequestException:
            time.sleep(0.2)
            continue
        if response.status_code == 404:
            job.missing += 1
            time.sleep(0.5)
            continue
        if response.status_code != 200:
            time.sleep(0.2)
            continue
        doc = response.json()
        if doc["status"] in TERMINAL:
            job.first_end, job.read_at = doc, time.monotonic()
            return


def _answer(doc: dict[str, Any] | None) -> tuple[Any, ...]:
    if doc is None:
        return (None,)
    return doc["status"], repr(doc.get("result")), repr((doc.get("error") or {}).get("code"))


def _tally(stack: ProcfileStack, run: FailoverRun) -> dict[str, Any]:
    session = session_for(8)
    ends: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    changed, redone, lost, expired_in_outage = [], [], [], 0
    outage_end = (run.killed_at or 0.0) + (run.first_202_after_kill_s or 0.0)
    for job in run.accepted:
        if job.first_end is None:
            lost.append(job.job_id)
            continue
        ends[job.first_end["status"]] += 1
        if job.first_end["status"] == "failed":
            failed[(job.first_end.get("error") or {}).get("code", "?")] += 1
        if job.first_end["status"] == "expired" and run.killed_at and job.deadline_at <= outage_end + 5:
            expired_in_outage += 1
        later = _read_again(session, f"{stack.url}/v1/jobs/{job.job_id}")
        if _answer(later) != _answer(job.first_end):
            changed.append(job.job_id)
        elif later and later.get("batch") != job.first_end.get("batch"):
            redone.append(job.job_id)
    supervisor = stack.supervisor.log_tail(2_000_000) if stack.supervisor else ""
    return {
        "accepted": len(run.accepted),
        "refused": dict(run.refused),
        **{k: ends[k] for k in TERMINAL},
        "failed_by": dict(failed),
        "expired_in_outage": expired_in_outage,
        "lost": len(lost),
        "lost_ids": lost[:10],
        "changed_after_read": len(changed),
        "changed_ids": changed[:10],
        "done_twice": len(redone),
        "read_404_then_found": sum(1 for j in run.accepted if j.missing and j.first_end is not None),
        "first_202_after_kill_s": run.first_202_after_kill_s,
        "restarted": supervisor.count(" restarted (pid"),
    }


def _read_again(session: requests.Session, url: str, give_up_s: float = 15.0) -> dict[str, Any] | None:
    """The job as a read answers it now (None: not found). A 503 is no answer: the service refuses to show an end
    its replicas do not hold yet (a replica resyncing after the failover), so the read is made again."""
    until = time.monotonic() + give_up_s
    while True:
        again = session.get(url, timeout=10)
        if again.status_code != 503 or time.monotonic() > until:
            return again.json() if again.status_code == 200 else None
        time.sleep(0.2)


def format_failover(tally: dict[str, Any]) -> str:
    failed = ", ".join(f"{k} x{v}" for k, v in tally["failed_by"].items()) or "none"
    refused = ", ".join(f"{k} x{v}" for k, v in tally["refused"].items()) or "none"
    first = tally["first_202_after_kill_s"]
    first_text = f"{first:.1f} s" if first is not None else "none"
    return "\n".join(
        [
            "| accepted | succeeded | failed | expired (in the outage) | lost | changed after read | done twice | "
            "first 202 after the kill | processes restarted |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {tally['accepted']} | {tally['succeeded']} | {tally['failed']} | {tally['expired']} "
            f"({tally['expired_in_outage']}) | {tally['lost']} | {tally['changed_after_read']} | {tally['done_twice']} "
            f"| {first_text} | {tally['restarted']} |",
            "",
            f"failed by reason: {failed}; refused at submit: {refused}; the killed primary came back as "
            f"{tally.get('killed_comes_back_as')}",
        ]
    )
