"""The history checker (bench.faults.history): each broken promise it must find, on histories written by hand."""

from __future__ import annotations

from bench.faults.history import History, Op, check, kept

DEADLINE_MS = 6000


def ended(status: str = "succeeded", detections: list | None = None, **extra) -> dict:
    doc = {"status": status, "result": {"detections": detections or [[1, 2]]} if status == "succeeded" else None}
    doc["error"] = None if status == "succeeded" else {"code": status}
    doc["timings_ms"] = extra.pop("timings", {"total": 50.0})
    return {**doc, **extra}


def submitted(history: History, job: str, at: float) -> None:
    history.record(Op("submit", job, at, at + 0.01, 202))


def read(history: History, job: str, at: float, doc: dict | None, code: int = 200, took: float = 0.05) -> None:
    history.ops.append(_read_op(history, job, at, doc, code, took))


def _read_op(history: History, job: str, at: float, doc: dict | None, code: int, took: float) -> Op:
    op = History().read(job, at, code, doc)
    return Op(op.kind, job, at, at + took, code, "", op.status, op.answer, op.moments, op.stages)


def test_a_kept_history_passes():
    history = History()
    submitted(history, "j1", 0.0)
    read(history, "j1", 0.1, {"status": "running"})
    read(history, "j1", 0.5, ended())
    read(history, "j1", 9.0, ended())
    verdict = check(history, DEADLINE_MS)
    assert kept(verdict) and verdict["accepted"] == 1 and verdict["ends"] == {"succeeded": 1}


def test_an_accepted_job_never_seen_ended_or_found_missing_at_the_end_is_lost():
    history = History()
    submitted(history, "never", 0.0)
    read(history, "never", 0.1, {"status": "queued"})
    submitted(history, "gone", 0.0)
    read(history, "gone", 0.5, ended())
    read(history, "gone", 9.0, None, code=404)
    verdict = check(history, DEADLINE_MS)
    assert verdict["lost"] == 2 and not kept(verdict)


def test_an_end_read_then_a_live_job_or_another_answer_is_a_read_gone_back():
    history = History()
    submitted(history, "j", 0.0)
    read(history, "j", 0.5, ended())
    read(history, "j", 2.0, {"status": "running"})
    read(history, "j", 3.0, ended(detections=[[9, 9]]))
    verdict = check(history, DEADLINE_MS)
    assert verdict["went_back"] == 1 and verdict["ended_twice"] == 1


def test_a_read_that_overlaps_the_first_end_read_is_not_after_it():
    history = History()
    submitted(history, "j", 0.0)
    read(history, "j", 0.5, ended(), took=1.0)  # answered at 1.5
    read(history, "j", 1.0, {"status": "running"})  # began before that answer: concurrent, not later
    assert kept(check(history, DEADLINE_MS))


def test_an_expiry_before_the_deadline_by_either_clock_is_early():
    history = History()
    submitted(history, "by-client", 0.0)
    read(history, "by-client", 0.3, ended("expired"))  # the client's 6 s had not passed
    submitted(history, "by-service", 0.0)
    doc = ended("expired", deadline_at="2026-12-05T10:00:06.000Z", finished_at="2026-12-05T10:00:05.500Z")
    read(history, "by-service", 7.0, doc)
    submitted(history, "in-time", 0.0)
    doc = ended("expired", deadline_at="2026-12-05T10:00:06.000Z", finished_at="2026-12-05T10:00:06.200Z")
    read(history, "in-time", 7.0, doc)
    verdict = check(history, DEADLINE_MS)
    assert verdict["expired_early"] == 2 and verdict["examples"]["expired_early"] == ["by-client", "by-service"]


def test_a_stage_longer_than_the_client_saw_is_billed_off_the_clock():
    history = History()
    submitted(history, "j", 0.0)
    read(history, "j", 0.1, ended(timings={"queue_gpu": 8000.0, "total": 240.0}), took=0.2)  # seen: 300 ms
    verdict = check(history, DEADLINE_MS)
    assert verdict["bills_off_clock"] == 1


def test_refusals_are_counted_by_phase_and_the_first_202_after_the_heal_is_timed():
    history = History(fault=(10.0, 30.0))
    history.record(Op("submit", None, 12.0, 12.1, 503, "backend-unavailable"))
    history.record(Op("submit", None, 31.0, 31.1, 503, "not-replicated"))
    history.record(Op("submit", "late", 33.0, 33.5, 202))
    read(history, "late", 33.6, ended())
    verdict = check(history, DEADLINE_MS)
    assert verdict["refused"] == {"during": {"503 backend-unavailable": 1}, "after": {"503 not-replicated": 1}}
    assert verdict["first_202_after_heal_s"] == 3.5
