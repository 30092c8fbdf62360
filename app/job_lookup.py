"""The job a request's id names, as the key asking may see it; otherwise the one answer an unknown id gets.

An id is checked before any Redis call (contract.jobs.ids): one made up, mistyped, or issued to another key is
404 job-not-found, the very answer to an id that names nothing, so the status tells no key whether another's id
exists. Only an id this deployment issued to the asking key, missing from the store while its record should
still be there, is 410 job-lost (so that a made-up id with a recent moment raises no false data-loss alarm).
"""

from __future__ import annotations

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


def is_ours_to_ask(services: Services, job_id: str) -> bool:
    """Whether `job_id` may name a job the caller can see: checked for its key, or of the format before checks."""
    return services.job_ids.verdict(job_id, asking_owner()) is not IdVerdict.NOT_OURS


def job_cell(services: Services, job_id: str) -> CellServices:
    """The cell `job_id` names (app.cells; the first for ids made before cells), read with no lookup; 404 for a
    cell this process does not have (an id of a cell since removed)."""
    cell = services.cells.of(job_id)
    if cell is None:
        raise not_found(job_id)
    return cell


def load_owned(services: Services, job_id: str) -> JobRecord:
    """The job, if it exists and the caller may see it; 404 otherwise (no hint that it exists), 410 when it was
    the caller's and the store lost it. An id that fails its check is 404 before any Redis call (`<id>:upload`
    would name another key)."""
    verdict = services.job_ids.verdict(job_id, asking_owner())
    if verdict is IdVerdict.NOT_OURS:
        raise not_found(job_id)
    cell = job_cell(services, job_id)
    store = cell.store
    try:
        record = store.load(job_id)
    except redis.RedisError as exc:  # with several cells, this one is then skipped for new jobs too
        if cell_unreachable(exc):
            services.cells.mark_down(cell)
        raise
    if (
        record is None
        and verdict is IdVerdict.OURS
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
