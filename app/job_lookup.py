"""The job a request's id names, as the key asking may see it; otherwise the one answer an unknown id gets.

An id is checked before any Redis call (contract.jobs.ids): one made up, mistyped, or issued to another key is
404 job-not-found, the very answer to an id that names nothing, so the status tells no key whether another's id
exists. Only an id this deployment issued to the asking key, missing from the store while its record should
still be there, is 410 job-lost (so that a made-up id with a recent moment raises no false data-loss alarm).
"""

from __future__ import annotations

from typing import NamedTuple

import redis
from flask import g

from app.auth import owns
from app.cells import CellServices, cell_unreachable
from app.problems import Problem, job_lost
from app.services import Services
from app.waiters import expire_if_late, until_ended
from contract.jobs.ids import IdVerdict
from contract.jobs.record import JobRecord, lost_at, utc_iso


def asking_owner() -> str:
    """The key id a job of this request's is issued to and checked against ("" without keys)."""
    return g.get("client_id") or ""


def not_found(job_id: str) -> Problem:
    return Problem(404, "job-not-found", "Job not found", f"no job {job_id!r} (unknown or expired)")


class Asked(NamedTuple):
    """A job id as this request may ask for it, known with no Redis call: its check's verdict and its cell."""

    job_id: str
    verdict: IdVerdict
    cell: CellServices


def ask(services: Services, job_id: str) -> Asked:
    """`job_id` checked for the asking key and placed in the cell it names (app.cells; the first for ids made
    before cells), once a request: 404 for an id issued to another key and for a cell this process does not
    have (an id of a cell since removed), before any Redis call (`<id>:upload` would name another key)."""
    verdict, place = services.job_ids.check(job_id, asking_owner())
    cell = services.cells.at(place)
    if verdict is IdVerdict.NOT_OURS or cell is None:
        raise not_found(job_id)
    return Asked(job_id, verdict, cell)


def owned(services: Services, job_id: str) -> tuple[Asked, JobRecord]:
    """`job_id` asked (ask) and its job loaded as the caller may see it (load_owned), in the one call a route makes."""
    asked = ask(services, job_id)
    return asked, load_owned(services, asked)


def read(services: Services, job_id: str, wait_s: float) -> tuple[CellServices, JobRecord]:
    """A read of `job_id` (its cell, and its job as the caller may see it, over if late): with `wait_s`, once it ends
    or the wait is over, counted among the process's long-polls (past a bound, 429 or 503 at once). The route's one
    call: the id is checked once here, at the edge, and goes from here to the store only."""
    asked = ask(services, job_id)  # checked and placed in its cell with no lookup: another key's id is 404 here
    cell = asked.cell
    # A cell found down lately holds no long-poll either (its 503 at once).
    if wait_s <= 0 or not services.cells.is_up(cell):
        return cell, expire_if_late(cell.store, load_owned(services, asked))
    with services.holds.wait(asking_owner(), wait_s):
        # Listen before the first read: an end announced after it wakes this request.
        event = cell.listener.register(job_id)
        try:
            record = until_ended(cell.store, job_id, load_owned(services, asked), wait_s, event)
        finally:
            cell.listener.unregister(job_id, event)
    return cell, expire_if_late(cell.store, record)


def load_owned(services: Services, asked: Asked) -> JobRecord:
    """The job, if it exists and the caller may see it; 404 otherwise (no hint that it exists), 410 when it was
    the caller's and the store lost it."""
    job_id, cell = asked.job_id, asked.cell
    store = cell.store
    try:
        record = store.load(job_id)
    except redis.RedisError as exc:  # with several cells, this one is then skipped for new jobs too
        if cell_unreachable(exc):
            services.cells.mark_down(cell)
        raise
    if (
        record is None
        and asked.verdict is IdVerdict.OURS
        and (issued := lost_at(job_id, services.settings.jobs.ttl_s)) is not None
    ):
        # Behind Sentinel, "lost" only once a connection the Sentinels' primary answers on still lacks it: an
        # idle connection left on a replaced primary would say 410 for a job the new one holds (503 then).
        store.confirm_durable()
        if (record := store.load(job_id)) is None:
            raise job_lost(job_id, utc_iso(issued))
    if record is None or not owns(record):  # owns: an unchecked id of another key's is as missing as any
        raise not_found(job_id)
    return record
