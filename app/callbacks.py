"""`POST /v1/callbacks/redeliver`: every callback of the caller's that was given up, queued again."""

from __future__ import annotations

from typing import Any, cast

from flask import Blueprint, Response, g, jsonify

from app.operations import Reply, operation
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
    """With API keys, only the caller's own jobs' callbacks; without, every one."""
    services = current_services()
    client, keys, store = services.redis, services.keys, services.store
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
    queued = sum(store.redeliver_callback(job_id) == REDELIVER_QUEUED for job_id in mine)
    return jsonify(Redelivered.model_validate({"redelivered": queued}).to_json())
