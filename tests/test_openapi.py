"""The OpenAPI document: generated from the code, complete, and true of the
running API (schemathesis over real HTTP against the real stack)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import requests
import schemathesis

from tests.support import jpeg, run_schemathesis

pytestmark = pytest.mark.integration


def test_every_route_is_documented(stack):
    document = requests.get(stack.url("/openapi.json"), timeout=10).json()
    served = {
        (rule.rule.replace("<job_id>", "{job_id}"), method.lower())
        for rule in stack.api.app.url_map.iter_rules()
        if rule.endpoint != "static"
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    documented = {(path, method) for path, methods in document["paths"].items() for method in methods}
    assert served == documented
    operation_ids = [op["operationId"] for methods in document["paths"].values() for op in methods.values()]
    links = [
        link
        for methods in document["paths"].values()
        for op in methods.values()
        for reply in op["responses"].values()
        for link in reply.get("links", {}).values()
    ]
    assert len(set(operation_ids)) == len(operation_ids) and links
    assert all(link["operationId"] in operation_ids for link in links)


def test_bounds_come_from_the_settings_and_the_models(stack):
    document = requests.get(stack.url("/openapi.json"), timeout=10).json()
    submit = document["paths"]["/v1/jobs"]["post"]
    parameters = {p["name"]: p["schema"] for p in submit["parameters"]}
    assert parameters["deadline_ms"]["maximum"] == stack.settings.jobs.default_deadline_ms
    assert parameters["conf"] == {"type": "number", "minimum": 0.0, "maximum": 1.0}
    wait = document["paths"]["/v1/jobs/{job_id}"]["get"]["parameters"][1]
    assert wait["name"] == "wait" and wait["schema"]["maximum"] == stack.settings.api.max_wait_s
    body = submit["requestBody"]["content"]
    assert body["multipart/form-data"]["schema"]["required"] == ["image"]
    assert body["image/jpeg"]["schema"]["maxLength"] == stack.settings.api.max_upload_bytes
    stages = document["components"]["schemas"]["TimeBill"]["properties"]
    assert list(stages) == [
        "receive",
        "queue_cpu",
        "decode",
        "resize",
        "backpressure",
        "queue_gpu",
        "batch_wait",
        "device_queue",
        "infer",
        "postprocess",
        "total",
    ]


def test_a_real_job_document_matches_its_schema(stack):
    """A succeeded job (result, batch, full time bill) validates against the generated schema."""
    schema = schemathesis.openapi.from_url(stack.url("/openapi.json"))
    job_id = stack.submit_ok(jpeg(200, 120))
    response = requests.get(stack.url(f"/v1/jobs/{job_id}"), params={"wait": 20}, timeout=40)
    assert response.json()["status"] == "succeeded"
    schema["/v1/jobs/{job_id}"]["GET"].validate_response(response)
    stats = requests.get(stack.url("/v1/stats"), timeout=10)
    schema["/v1/stats"]["GET"].validate_response(stats)
    assert stats.json()["gpu"]["workers"] >= 1


def test_the_docs_page_lists_every_operation(stack):
    page = requests.get(stack.url("/docs"), timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    document = requests.get(stack.url("/openapi.json"), timeout=10).json()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            assert f'id="{operation["operationId"]}"' in page.text, (method, path)
    assert 'id="JobDocument"' in page.text
    # Nothing from a CDN: its one script is this service's own (tests/test_home.py).
    assert re.findall(r'src="([^"]*)"', page.text) == ["docs/try.js"]


def test_the_main_flow_comes_first(stack):
    """Issue 60: /docs opened on `POST /v1/callbacks/redeliver` (the path that sorts first). Submit, read and
    cancel come first, in the document and on the page, then the rest."""
    document = requests.get(stack.url("/openapi.json"), timeout=10).json()
    operations = [(method, path) for path, methods in document["paths"].items() for method in methods]
    assert operations[:3] == [("post", "/v1/jobs"), ("get", "/v1/jobs/{job_id}"), ("delete", "/v1/jobs/{job_id}")]
    assert operations.index(("post", "/v1/callbacks/redeliver")) > 2
    page = requests.get(stack.url("/docs"), timeout=10).text
    ids = [document["paths"][path][method]["operationId"] for method, path in operations]
    positions = [page.index(f'id="{operation_id}"') for operation_id in ids]
    assert positions == sorted(positions)


def test_schemathesis_finds_nothing(stack):
    result = run_schemathesis(stack.api.url)
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-3000:]


def test_the_fuzz_hook_drops_only_a_violation_that_never_reached_the_wire():
    from types import SimpleNamespace

    from schemathesis.core.failures import AcceptedNegativeData, ServerError

    from tests.fuzz_hooks import filter_failure

    def accepted(message: str) -> AcceptedNegativeData:
        return AcceptedNegativeData(
            operation="POST /v1/jobs", message=message, status_code=202, expected_statuses=["400"]
        )

    def keeps(failure: Any, media_type: str, body: dict[str, Any]) -> bool:
        return filter_failure(None, failure, SimpleNamespace(media_type=media_type, body=body), None)

    conf_array = accepted("Invalid component: in body - violates `type` at /properties/conf (was number, became array)")
    form = "multipart/form-data"
    assert not keeps(conf_array, form, {"image": b"x", "conf": []})  # sent as the image alone: valid
    assert keeps(conf_array, form, {"image": b"x", "conf": [1]})  # a part that says 1: refuse it
    assert keeps(conf_array, "application/json", {"conf": []})
    assert keeps(accepted("no property named"), form, {"conf": []})
    assert keeps(ServerError(operation="POST /v1/jobs", status_code=500), form, {"conf": []})


def test_every_429_and_503_documents_its_retry_after_and_the_submit_s_say_which_limits(stack):
    """Issue 69: the 503s documented no Retry-After, and the submission's 429 left out the bytes budget."""
    document = requests.get(stack.url("/openapi.json"), timeout=10).json()
    busy = [
        (f"{method} {path}", status, reply)
        for path, methods in document["paths"].items()
        for method, op in methods.items()
        for status, reply in op["responses"].items()
        if status in ("429", "503") and reply.get("content", {}).get("application/problem+json")
    ]
    assert {status for _, status, _ in busy} == {"429", "503"}
    undocumented = [(where, status) for where, status, reply in busy if "Retry-After" not in reply.get("headers", {})]
    assert not undocumented
    submit = document["paths"]["/v1/jobs"]["post"]["responses"]
    assert "bytes" in submit["429"]["description"] and "backlog" in submit["429"]["description"]
    assert "full" in submit["503"]["description"]
