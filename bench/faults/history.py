"""Every client operation against the service, recorded as it happened, and a checker that reads the history
afterwards (as Jepsen does): what a `202` promised, was it kept?

The client records each submit (its answer: 202 and the job id, or the refusal) and each read of a job (its
HTTP answer, and for a job that had ended, how: status, a digest of the result or error, and the job's own
moments). `check` then says, for the accepted jobs:

- lost: a 202 whose job no read found ended at the last (404, 410, or never over);
- went back: a read that showed an end, followed by a read (begun after it was answered) that showed the job
  live again, or ended otherwise (another status or answer);
- ended twice: two reads that showed different ends, whatever their order;
- expired early: a job that ended `expired` before its deadline: by the service's clock (the job's own
  `finished_at` before its `deadline_at`), or by the client's (the expiry read before the client's
  `deadline_ms` had passed since it began to send the job: the service cannot have received it earlier);
- bills off the clock: a stage of a time bill longer than the job took as its client saw it (submit begun to
  the end first read), or negative: a stage billed across hosts whose clocks disagree.

Refusals (503, 429, a connection error) are counted by kind, and when they came: before, during and after a
fault's window; the first 202 after the window says how soon the service took jobs again.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from contract.jobs.record import TERMINAL

CLOCK_SLACK_S = 0.05  # a stage may exceed what the client saw by this much (the clocks' own error)


@dataclass(frozen=True)
class Op:
    """One client operation: `kind` submit or read, its client-side start and end (monotonic seconds), its
    outcome: an HTTP status, or an exception's name, and what it said."""

    kind: str
    job: str | None
    started: float
    ended: float
    code: int | str
    problem: str = ""  # a problem's type, its last part
    status: str | None = None  # the job's status, as read
    answer: str | None = None  # an ended job's: status and a digest of its result or error
    moments: tuple[float, float] | None = None  # an ended job's (deadline_at, finished_at): the service's clock
    stages: tuple[tuple[str, float], ...] = ()  # its time bill


def answer_of(doc: dict[str, Any]) -> str:
    """An ended job's answer as a short digest: its status and its result's or error's code (the batch it ran
    in, or its timings, are not part of the answer)."""
    result = doc.get("result")
    detections = None if result is None else result.get("detections")
    error = (doc.get("error") or {}).get("code")
    body = json.dumps([doc.get("status"), detections, error], sort_keys=True)
    return f"{doc.get('status')}:{hashlib.sha1(body.encode()).hexdigest()[:12]}"


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # When the fault began and ended (monotonic): what came before, during and after is told apart.
    fault: tuple[float, float] | None = None

    def record(self, op: Op) -> Op:
        with self.lock:
            self.ops.append(op)
        return op

    def submit(self, started: float, code: int | str, job: str | None = None, problem: str = "") -> Op:
        return self.record(Op("submit", job, started, time.monotonic(), code, problem))

    def read(self, job: str, started: float, code: int | str, doc: dict[str, Any] | None, problem: str = "") -> Op:
        status = doc.get("status") if doc else None
        ended = status in TERMINAL
        moments = None
        if ended and doc and doc.get("deadline_at") and doc.get("finished_at"):
            moments = (_epoch(doc["deadline_at"]), _epoch(doc["finished_at"]))
        stages = tuple(sorted((doc or {}).get("timings_ms", {}).items())) if ended else ()
        return self.record(
            Op(
                "read",
                job,
                started,
                time.monotonic(),
                code,
                problem,
                status,
                answer_of(doc) if ended and doc else None,
                moments,
                stages,
            )
        )

    def accepted(self) -> dict[str, Op]:
        return {op.job: op for op in self.ops if op.kind == "submit" and op.code == 202 and op.job}

    def reads(self) -> dict[str, list[Op]]:
        by_job: dict[str, list[Op]] = {}
        for op in sorted(self.ops, key=lambda o: o.started):
            if op.kind == "read" and op.job:
                by_job.setdefault(op.job, []).append(op)
        return by_job


def check(history: History, deadline_ms: int) -> dict[str, Any]:
    """The checker (see the module's note): counts, and up to ten job ids per kind of violation."""
    accepted, reads = history.accepted(), history.reads()
    lost, went_back, ended_twice, expired_early, off_clock = [], [], [], [], []
    ends: Counter[str] = Counter()
    live_regressions = 0
    for job, submit in accepted.items():
        mine = reads.get(job, [])
        answers = [op for op in mine if op.answer is not None]
        last = [op for op in mine if isinstance(op.code, int) and op.code in (200, 404, 410)]
        if not answers or (last and last[-1].code != 200):
            lost.append(job)
            continue
        first = min(answers, key=lambda op: op.ended)
        ends[first.status or "?"] += 1
        if len({op.answer for op in answers}) > 1:
            ended_twice.append(job)
        later = [op for op in mine if op.started > first.ended and op.code == 200]
        if any(op.answer != first.answer for op in later):
            went_back.append(job)
        live_regressions += _live_regressions(mine)
        if first.status == "expired" and _expired_early(submit, first, deadline_ms):
            expired_early.append(job)
        if _off_clock(submit, first):
            off_clock.append(job)
    return {
        "accepted": len(accepted),
        "ends": dict(ends),
        "lost": len(lost),
        "went_back": len(went_back),
        "ended_twice": len(ended_twice),
        "expired_early": len(expired_early),
        "bills_off_clock": len(off_clock),
        "live_status_went_back": live_regressions,
        "examples": {
            name: ids[:10]
            for name, ids in (
                ("lost", lost),
                ("went_back", went_back),
                ("ended_twice", ended_twice),
                ("expired_early", expired_early),
                ("bills_off_clock", off_clock),
            )
            if ids
        },
        **_refusals(history),
    }


def kept(verdict: dict[str, Any]) -> bool:
    """Every promise kept: nothing lost, gone back, ended twice, expired early or billed off the clock."""
    return not any(verdict[k] for k in ("lost", "went_back", "ended_twice", "expired_early", "bills_off_clock"))


ORDER = ("queued", "preprocessing", "queued_gpu", "running")


def _live_regressions(reads: Iterable[Op]) -> int:
    """Reads of a live job that showed an earlier stage than one read before (work done again after a failover
    or a worker's death: not a broken promise, counted to show it)."""
    seen, count = -1, 0
    for op in reads:
        if op.status in ORDER:
            stage = ORDER.index(op.status)
            count += stage < seen
            seen = max(seen, stage)
    return count


def _expired_early(submit: Op, first: Op, deadline_ms: int) -> bool:
    if first.moments is not None and first.moments[1] < first.moments[0]:
        return True  # by the service's own clock
    return first.ended - submit.started < deadline_ms / 1000.0 - CLOCK_SLACK_S


def _off_clock(submit: Op, first: Op) -> bool:
    seen_ms = (first.ended - submit.started) * 1000.0 + CLOCK_SLACK_S * 1000.0
    return any(value < 0 or value > seen_ms for _, value in first.stages)


def _refusals(history: History) -> dict[str, Any]:
    """Submissions refused, by kind and by phase, and the first 202 after the fault's window."""
    by_phase: dict[str, Counter[str]] = {"before": Counter(), "during": Counter(), "after": Counter()}
    first_after = None
    for op in history.ops:
        if op.kind != "submit":
            continue
        phase = _phase(history.fault, op.ended)  # a refusal answered in the fault is the fault's
        if op.code == 202:
            if phase == "after" and history.fault and (first_after is None or op.ended < first_after):
                first_after = op.ended
            continue
        by_phase[phase][f"{op.code} {op.problem}".strip()] += 1
    return {
        "refused": {phase: dict(counts) for phase, counts in by_phase.items() if counts},
        "first_202_after_heal_s": None
        if first_after is None or history.fault is None
        else round(first_after - history.fault[1], 2),
        "submitted": sum(1 for op in history.ops if op.kind == "submit"),
    }


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _phase(fault: tuple[float, float] | None, at: float) -> str:
    if fault is None or at < fault[0]:
        return "before"
    return "during" if at <= fault[1] else "after"
