"""`POST /v1/callbacks/redeliver`: every callback of the caller's that was given up, queued again."""

from __future__ import annotations

from typing import Any, cast

import redis
from flask import Blueprint, Response, g, jsonify

from app.cells import CellServices, cell_unreachable
from app.openapi import Reply, operation
from app.services import services as current_services
from contract.documents import Redelivered
from contract.jobs.ending import REDELIVER_QUEUED

blueprint = Blueprint("callbacks", __name__)


@blueprint.post("/v1/callbacks/redeliver")
@operation(
    "Deliver again every callback of yours that was given up (the dead letters)",
    tag="jobs",
    problems=(503,),
    replies={200: Reply("How many were queued again", Redelivered)},
)
def redeliver_dead() -> Response:
    """With API keys, only the caller's own jobs' callbacks; without, every one. In every cell (docs/cells.md):
    with several, a cell that does not answer is left for a later request."""
    services = current_services()
    queued = 0
    for cell in services.cells:
        try:
            queued += _redeliver_in(cell)
        except redis.RedisError as exc:
            if len(services.cells) == 1 or not cell_unreachable(exc):
                raise
    return jsonify(Redelivered.model_validate({"redelivered": queued}).to_json())


def _redeliver_in(cell: CellServices) -> int:
    client, keys, store = cell.redis, cell.keys, cell.store
    caller = g.get("client_id")
    dead = [job_id.decode() for job_id in cast(list[bytes], client.zrange(keys.callback_dead, 0, -1))]
    pipe = client.pipeline(transaction=False)
    for job_id in dead:
        pipe.hget(keys.job(job_id), "owner")
    owners: list[Any] = pipe.execute() if dead else []
    mine = [
        job_id
        for job_id, owner in zip(dead, owners)
        if caller is None or (owner is not None and owner.decode() == caller)
    ]
    return sum(store.redeliver_callback(job_id) == REDELIVER_QUEUED for job_id in mine)
