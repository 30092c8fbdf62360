"""`callback.next_attempt_at` in the job document (issue 69): unix seconds where every other moment the service
shows is ISO 8601. Now ISO 8601 (UTC, milliseconds, `Z`) like created_at and finished_at; the stored state keeps
its number, which the redelivery step compares with its clock."""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime

from contract.documents import CallbackState, job_document
from contract.jobs.ending import JobEnding
from contract.jobs.record import SUCCEEDED, utc_iso
from contract.redis.keys import Keys
from contract.settings.config import load_settings
from tasks.callbacks.delivery import CallbackSender
from tests.conftest import CALLBACK_SECRET
from tests.test_callbacks import Receiver

JOB_ID = "r" * 32


def test_a_retrying_callbacks_next_attempt_is_iso_8601_like_the_jobs_other_moments(redis_client):
    base = load_settings()
    settings = dataclasses.replace(
        base,
        namespace="retrytime",
        callbacks=dataclasses.replace(
            base.callbacks, secret=CALLBACK_SECRET, allow_hosts=("127.0.0.1",), backoff_base_s=30, backoff_max_s=60
        ),
    )
    keys = Keys("retrytime")
    store = JobEnding(redis_client, keys, 60)
    receiver = Receiver(failures=10**6)
    redis_client.hset(
        keys.job(JOB_ID),
        # submitted now: a record lives jobs.max_ttl_s from its submission, and its callback retries within that
        mapping={"id": JOB_ID, "status": "running", "callback_url": receiver.url, "received_at": time.time()},
    )
    store.finish(
        JOB_ID,
        SUCCEEDED,
        {"result": {"detections": [], "image": {"width": 1, "height": 1}, "model": {"name": "m", "version": "1"}}},
    )
    try:
        assert CallbackSender(settings, redis_client).deliver(JOB_ID) == "retrying"
    finally:
        receiver.stop()
    record = store.load(JOB_ID)
    stored = record["callback"]["next_attempt_at"]
    assert isinstance(stored, float)  # the stored state keeps its number (contract.jobs.ending compares it)

    document = job_document(record)
    shown = document["callback"]["next_attempt_at"]
    assert shown == utc_iso(stored) and shown.endswith("Z"), document["callback"]
    assert 0 <= stored - datetime.fromisoformat(shown).astimezone(UTC).timestamp() < 0.001
    assert document["finished_at"].endswith("Z")  # the same form as the job's other moments
    schema = CallbackState.model_json_schema()["properties"]["next_attempt_at"]
    assert schema.get("format") == "date-time" and "string" in str(schema), schema
