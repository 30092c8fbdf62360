"""The OpenAPI 3.1 document (`/openapi.json`) and its docs page (`/docs`).

Nothing here is written by hand twice: each view declares what it reads and
answers with `@operation(...)`, naming models from `contract.documents` (the
same ones that validate its input and build its output), and the document is
generated from the app's URL map, its settings and those models the first
time it is asked for, then kept on the app with its JSON and its page as bytes
(nothing it reads changes while the app runs; `published`).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from flask import Blueprint, Flask, Response, current_app, render_template_string
from markupsafe import Markup, escape
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.operations import Operation, Reply, operation
from app.problems import PROBLEM_TYPE
from app.services import services as current_services
from app.uploads import ACCEPTED_TYPES, ACCEPTED_TYPES_TEXT
from contract.documents import ProblemDocument
from contract.jobs.record import JOB_ID_PATTERN
from contract.settings import Settings

blueprint = Blueprint("openapi", __name__)

SCHEMA_REF = "#/components/schemas/{model}"
TAGS = ("jobs", "models", "stats", "health", "meta")  # the order of the docs page
PROBLEMS = {
    400: "A parameter is invalid (named in `invalid_params`)",
    401: "No or an unknown API key (only when keys are configured)",
    404: "No such job, it expired, or it belongs to another key",
    409: "The job already ended",
    413: "The upload is over `api.max_upload_bytes`",
    415: f"The upload is not {ACCEPTED_TYPES_TEXT}",
    429: "Too many jobs waiting, or this key is over its rate; retry after `Retry-After` seconds",
    503: "Redis or the broker is unreachable; retry shortly",
}
HEADERS = {
    "Location": {"description": "the job's URL", "schema": {"type": "string"}},
    "Content-Location": {
        "description": "the job's URL: the body is the job as a read of it answers",
        "schema": {"type": "string"},
    },
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}},
}
PATH_PARAMETERS = {
    "job_id": {
        "description": "the `id` the submission answered with",
        "schema": {"type": "string", "pattern": JOB_ID_PATTERN},
    },
}
# Statuses whose problem documents always carry these headers.
PROBLEM_HEADERS = {429: ("Retry-After",)}


def image_body(settings: Settings, options: type[BaseModel]) -> dict[str, Any]:
    """The submission body: the raw image, or multipart with an `image` file and the options."""
    binary = {"type": "string", "format": "binary", "maxLength": settings.api.max_upload_bytes}
    form: dict[str, Any] = {
        "type": "object",
        "required": ["image"],
        "additionalProperties": False,
        "properties": {"image": binary, **_parameter_schemas(options)},
    }
    content: dict[str, Any] = {"multipart/form-data": {"schema": form}}
    content.update({media_type: {"schema": binary} for media_type in (*ACCEPTED_TYPES, "application/octet-stream")})
    return {
        "required": True,
        "content": content,
        "description": "The image, as the raw body or as the `image` field of a multipart form. "
        "Its bytes decide its type, whatever the declared one.",
    }


def build_document(app: Flask) -> dict[str, Any]:
    settings = current_services(app).settings
    registry = _SchemaRegistry()
    paths: dict[str, dict[str, Any]] = {}
    declared_rules = [
        (rule, getattr(app.view_functions[rule.endpoint], "openapi", None)) for rule in app.url_map.iter_rules()
    ]
    for rule, declared in sorted(
        ((r, d) for r, d in declared_rules if d is not None), key=lambda item: (TAGS.index(item[1].tag), item[0].rule)
    ):
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            paths.setdefault(path, {})[method.lower()] = _render(
                declared, rule.arguments, settings, registry, f"{rule.endpoint}.{method.lower()}"
            )
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "imgserve", "version": service_version(), "description": DESCRIPTION},
        "paths": paths,
        "components": {"schemas": registry.resolve()},
    }
    if settings.auth.api_keys:
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return document


def _render(
    declared: Operation, path_arguments: set[str], settings: Settings, registry: _SchemaRegistry, operation_id: str
) -> dict[str, Any]:
    guarded = bool(settings.auth.api_keys) and not declared.public
    problems = dict(p if isinstance(p, tuple) else (p, PROBLEMS[p]) for p in declared.problems)
    if guarded:
        problems = {401: PROBLEMS[401], 429: PROBLEMS[429], **problems}
    responses = {str(status): _reply(reply, registry) for status, reply in declared.replies.items()}
    for status, meaning in sorted(problems.items()):
        responses[str(status)] = _reply(
            Reply(meaning, ProblemDocument, PROBLEM_TYPE, headers=PROBLEM_HEADERS.get(status, ())), registry
        )
    rendered: dict[str, Any] = {
        "operationId": operation_id.replace(".", "_"),
        "summary": declared.summary,
        "tags": [declared.tag],
        "responses": responses,
    }
    if declared.description:
        rendered["description"] = declared.description
    parameters = [
        {"name": name, "in": "path", "required": True, **PATH_PARAMETERS[name]} for name in sorted(path_arguments)
    ]
    if declared.query:
        parameters += [
            {
                "name": name,
                "in": "query",
                "required": False,
                "schema": schema,
                "description": schema.pop("description", ""),
            }
            for name, schema in _parameter_schemas(declared.query(settings)).items()
        ]
    if parameters:
        rendered["parameters"] = parameters
    if declared.body:
        rendered["requestBody"] = declared.body(settings)
    if guarded:
        rendered["security"] = [{"apiKey": []}]
    return rendered


def _reply(reply: Reply, registry: _SchemaRegistry) -> dict[str, Any]:
    rendered: dict[str, Any] = {"description": reply.description}
    schema = registry.ref(reply.model) if reply.model else reply.schema
    if schema is not None:
        rendered["content"] = {reply.media_type: {"schema": schema}}
    if reply.headers:
        rendered["headers"] = {name: {**HEADERS[name], "required": True} for name in reply.headers}
    if reply.links:
        rendered["links"] = reply.links
    return rendered


def _parameter_schemas(model: type[BaseModel]) -> dict[str, dict[str, Any]]:
    """A flat model's fields as parameter schemas (unset means absent, never null)."""
    properties = model.model_json_schema()["properties"]
    return {
        name: {k: v for k, v in schema.items() if k != "title" and not (k == "default" and v is None)}
        for name, schema in properties.items()
    }


class _SchemaRegistry:
    """Hands out `$ref` placeholders, then fills them in with one pydantic pass over every model
    (so shared sub-models appear once under components/schemas)."""

    def __init__(self) -> None:
        self._wanted: list[tuple[type[BaseModel], dict[str, Any]]] = []

    def ref(self, model: type[BaseModel]) -> dict[str, Any]:
        placeholder: dict[str, Any] = {}
        self._wanted.append((model, placeholder))
        return placeholder

    def resolve(self) -> dict[str, Any]:
        models = list(dict.fromkeys(model for model, _ in self._wanted))
        refs, schemas = models_json_schema([(model, "serialization") for model in models], ref_template=SCHEMA_REF)
        for model, placeholder in self._wanted:
            placeholder.update(refs[(model, "serialization")])
        return _without_null_defaults(schemas.get("$defs", {}))


def _without_null_defaults(value: Any) -> Any:
    """Fields that are absent when unset carry pydantic's `default: null`; the wire never has it."""
    if isinstance(value, dict):
        return {k: _without_null_defaults(v) for k, v in value.items() if not (k == "default" and v is None)}
    if isinstance(value, list):
        return [_without_null_defaults(v) for v in value]
    return value


def service_version() -> str:
    try:
        return metadata.version("imgserve")
    except metadata.PackageNotFoundError:
        return "0.0.0"


DESCRIPTION = """\
Object detection as a service that keeps the GPU fed.

Submit an image with `POST /v1/jobs` (the raw body, or a multipart form with an `image` field): the answer is
`202` with the job's id and a `Location`. Then read `GET /v1/jobs/{job_id}`; add `?wait=20` to long-poll until
the job ends. Or in one call: `POST /v1/jobs?wait=20` answers `200` with the finished job when it ends within
those seconds (`202` as above when it has not). A job ends `succeeded` (with `result.detections` in the original image's pixels), `failed`,
`expired` (past its `deadline_ms`) or `cancelled`. `timings_ms` is the job's time bill: how long each stage took.

With `callback_url`, the job document is also POSTed there once it ends, signed:
`X-Signature: sha256=<hex HMAC-SHA256 of "<X-Imgserve-Timestamp>.<body>" with the shared secret>`.

Every error is an RFC 9457 problem document (`application/problem+json`). `429` and `503` carry `Retry-After`.
When API keys are configured, every `/v1` route needs `Authorization: Bearer <key>`.
"""


@blueprint.get("/openapi.json")
@operation(
    "This OpenAPI document", tag="meta", public=True, replies={200: Reply("OpenAPI 3.1", schema={"type": "object"})}
)
def openapi_document() -> Response:
    return Response(published(current_app).json, mimetype="application/json")


@blueprint.get("/docs")
@operation(
    "Human-readable API documentation",
    tag="meta",
    public=True,
    replies={200: Reply("An HTML page rendered from /openapi.json", media_type="text/html", schema={"type": "string"})},
)
def docs_page() -> Response:
    return Response(published(current_app).html, mimetype="text/html")


@dataclass(frozen=True)
class Published:
    """The document and both its renderings, as served: bytes made once."""

    document: dict[str, Any]
    json: bytes
    html: bytes


_publishing = threading.Lock()


def published(app: Flask) -> Published:
    """Built once per app (an app has one settings, and its routes and settings do not change while it
    serves), on first use: rendering the page cost 45 ms of CPU a call, and anyone may ask for it without a
    key (8 clients fetching it took authenticated calls from a p90 of 22 ms to 1.2 s)."""
    built = app.extensions.get("imgserve.openapi")
    if built is None:
        with _publishing:  # several first calls at once build it once
            built = app.extensions.get("imgserve.openapi")
            if built is None:
                document = build_document(app)
                with app.app_context():
                    html = render_template_string(
                        DOCS_TEMPLATE, doc=document, describe=describe_schema, code=code_spans
                    )
                    built = Published(document, app.json.dumps(document).encode(), html.encode())
                app.extensions["imgserve.openapi"] = built
    return built


def code_spans(text: str) -> Markup:
    """Markdown's `code` as <code>, everything else escaped."""
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", str(escape(text or ""))))


def describe_schema(schema: dict[str, Any]) -> str:
    """A one-line type for the docs page: `JobDocument`, `integer 1..1000`, `Detection[]`, `string | null`."""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " | ".join(describe_schema(s) for s in schema["anyOf"])
    if "enum" in schema or "const" in schema:
        return " | ".join(repr(v) for v in schema.get("enum", [schema.get("const")]))
    kind = schema.get("type", "any")
    if kind == "array":
        return describe_schema(schema.get("items", {})) + "[]"
    if kind == "object" and "additionalProperties" in schema:
        return "map of " + describe_schema(schema["additionalProperties"])
    low, high = schema.get("minimum"), schema.get("maximum")
    bounds = (
        f" {low if low is not None else ''}..{high if high is not None else ''}" if (low, high) != (None, None) else ""
    )
    return f"{kind}{' (' + schema['format'] + ')' if 'format' in schema else ''}{bounds}"


DOCS_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ doc.info.title }} API {{ doc.info.version }}</title>
<style>
body{font:15px/1.5 system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
code,pre{font:13px ui-monospace,monospace;background:#f4f4f4;padding:1px 4px;border-radius:3px}
pre{padding:.8em;white-space:pre-wrap}
table{border-collapse:collapse;width:100%;margin:.4em 0 1em}
td,th{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
.op{border:1px solid #ccc;border-radius:6px;padding:.2em 1em;margin:1em 0}
.m{display:inline-block;min-width:4.5em;font-weight:bold;color:#fff;border-radius:3px;text-align:center}
.get{background:#2b7bb9}.post{background:#2e8b57}.delete{background:#b22222}
form.try{background:#fafafa;border-top:1px dashed #ccc;margin:.5em -1em 0;padding:.5em 1em}
form.try label{margin-right:1em;white-space:nowrap}
</style><script src="docs/try.js" defer></script></head><body>
<h1>{{ doc.info.title }} API <small>{{ doc.info.version }}</small></h1>
{% for para in doc.info.description.split("\n\n") %}<p>{{ code(para) }}</p>{% endfor %}
<p>Machine-readable: <a href="openapi.json"><code>/openapi.json</code></a> (OpenAPI {{ doc.openapi }}).
Each operation's <b>Try it</b> sends its request to this service from the browser.</p>
{% if doc.components.securitySchemes %}<p><label>API key (sent as <code>Authorization: Bearer</code>)
<input id="api-key" type="password" autocomplete="off"></label></p>{% endif %}
{% for path, methods in doc.paths.items() %}{% for method, op in methods.items() %}
<div class="op" id="{{ op.operationId }}">
<h3><span class="m {{ method }}">{{ method|upper }}</span> <code>{{ path }}</code> {{ op.summary }}</h3>
{% if op.description %}<p>{{ code(op.description) }}</p>{% endif %}
{% if op.security %}<p>Needs <code>Authorization: Bearer &lt;key&gt;</code>.</p>{% endif %}
{% if op.parameters %}<table><tr><th>Parameter</th><th>In</th><th>Type</th><th>Description</th></tr>
{% for p in op.parameters %}<tr><td><code>{{ p.name }}</code></td><td>{{ p.in }}</td>
<td>{{ describe(p.schema) }}</td><td>{{ code(p.description) }}</td></tr>{% endfor %}</table>{% endif %}
{% if op.requestBody %}<p><b>Body</b>: {{ code(op.requestBody.description) }}<br>
{% for media in op.requestBody.content %}<code>{{ media }}</code> {% endfor %}</p>{% endif %}
<form class="try" data-method="{{ method|upper }}" data-path="{{ path }}"><b>Try it</b>
{% for p in op.parameters or [] %}<label><code>{{ p.name }}</code> <input name="{{ p.name }}" data-in="{{ p.in }}"
{% if p.required %}required {% endif %}placeholder="{{ describe(p.schema) }}"></label> {% endfor %}
{% if op.requestBody %}<label><code>image</code> <input name="image" type="file" accept="image/*" required></label>
{% endif %}<button>Send</button><pre class="answer" hidden></pre></form>
<table><tr><th>Status</th><th>Description</th><th>Body</th></tr>
{% for status, reply in op.responses.items() %}<tr><td>{{ status }}</td><td>{{ code(reply.description) }}{% for name, link in (reply.links or {}).items() %}<br>next: <a href="#{{ link.operationId }}">{{ name }}</a>{% endfor %}</td><td>
{% for media, body in (reply.content or {}).items() %}<code>{{ media }}</code>
{% if body.schema and body.schema["$ref"] %}<a href="#{{ describe(body.schema) }}">{{ describe(body.schema) }}</a>{% endif %}
{% endfor %}</td></tr>{% endfor %}</table></div>
{% endfor %}{% endfor %}
<h2>Schemas</h2>
{% for name, schema in doc.components.schemas.items() %}
<h3 id="{{ name }}">{{ name }}</h3>{% if schema.description %}<p>{{ code(schema.description) }}</p>{% endif %}
<table><tr><th>Field</th><th>Type</th><th>Required</th><th>Description</th></tr>
{% for field, prop in (schema.properties or {}).items() %}<tr><td><code>{{ field }}</code></td>
<td>{{ describe(prop) }}</td><td>{{ "yes" if field in (schema.required or []) else "" }}</td>
<td>{{ code(prop.description) }}</td></tr>{% endfor %}</table>
{% endfor %}
</body></html>
"""
