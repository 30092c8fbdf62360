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
