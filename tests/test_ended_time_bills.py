"""Jobs that end without an answer carry their time bill too (issue 69): a failed or cancelled job showed
`timings_ms: {}` though every job has one. It bills the stages the job went through, up to its end."""

from __future__ import annotations

import secrets
import time
from datetime import datetime

import pytest

from contract.jobs.intake import JobIntake
from tests.support import jpeg

pytestmark = pytest.mark.integration


def _span_ms(document: dict) -> float:
    """created_at -> finished_at as the document shows them (milliseconds, truncated)."""
    created, finished = (datetime.fromisoformat(document[name]) for name in ("created_at", "finished_at"))
    return (finished - created).total_seconds() * 1000


def test_a_job_failed_at_decode_bills_its_receive_its_queue_and_its_total(stack):
    job_id = stack.submit_ok(jpeg(320, 240)[:400])  # a JPEG cut short: the API takes it, the decode fails
    document = stack.wait_terminal(job_id)
    assert document["status"] == "failed", document
    bill = document["timings_ms"]
    assert {"receive", "queue_cpu", "total"} <= set(bill), bill
    assert not {"queue_gpu", "batch_wait", "infer"} & set(bill), bill  # never reached the GPU worker
    assert bill["total"] >= bill["receive"] + bill["queue_cpu"]
    assert abs(bill["total"] - _span_ms(document)) < 2.0, (bill, document)


def test_a_cancelled_job_bills_its_receive_and_its_total(stack):
    """A job stored and never taken (no task sent: no worker can end it first), then cancelled over HTTP."""
    job_id = "0" + secrets.token_hex(16)[1:]  # an id of the unchecked form, which the API reads as before
    now = time.time()
    fields = {"model": stack.settings.model.key, "received_at": now - 0.5, "submitted_at": now - 0.45}
    JobIntake(stack.redis, stack.keys, ttl_s=60).create(job_id, jpeg(32, 32), 60, fields)
    answer = stack.session.delete(stack.url(f"/v1/jobs/{job_id}"), timeout=10)
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled", answer.text
    for document in (answer.json(), stack.job(job_id)):
        bill = document["timings_ms"]
        assert set(bill) == {"receive", "total"}, bill
        assert 49 <= bill["receive"] <= 51 and bill["total"] >= 500, bill
        assert abs(bill["total"] - _span_ms(document)) < 2.0, (bill, document)
