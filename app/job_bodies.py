"""A job's document as the API serves it: the result spliced in as the GPU worker stored it.

A result holds up to max_det's cap of detections, tens of KB of JSON. Parsed, validated and encoded again on
every read, it would cost the API's event loop many times a small job's CPU, and a few connections re-reading
one would starve every other request of the process (docs/benchmarks/2026-12-06-big-answers-and-costly-options.md). The
result is written by the GPU worker alone (the cache holds a copy of what one wrote), compact JSON in the contract's
shape: it is served as those bytes, and what is validated here is the rest of the document, the same size for every job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Response, current_app

from contract.documents import job_document
from contract.jobs.record import JobRecord, StoredJSON


def job_response(record: JobRecord) -> Response:
    """`job_document(record)` as a JSON response, its result (a StoredJSON) never parsed."""
    result = record.get("result")
    if not isinstance(result, StoredJSON):
        return document_response(job_document(record))
    return document_response(job_document({**record, "result": None}), {"result": result})


def document_response(document: Mapping[str, Any], stored: Mapping[str, StoredJSON] | None = None) -> Response:
    """`document` as jsonify would answer it, with each member named in `stored` replaced by its stored text."""
    return current_app.response_class(spliced_json(document, stored or {}) + "\n", mimetype="application/json")


def spliced_json(document: Mapping[str, Any], stored: Mapping[str, StoredJSON]) -> str:
    """The compact JSON of `document`, its members in their order, each named in `stored` as that text."""
    encode = current_app.json.dumps
    if not stored:
        return encode(document, separators=(",", ":"))
    members = (
        encode(name) + ":" + (stored[name].text if name in stored else encode(value, separators=(",", ":")))
        for name, value in document.items()
    )
    return "{" + ",".join(members) + "}"
