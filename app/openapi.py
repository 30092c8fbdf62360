"""The OpenAPI 3.1 document (`/openapi.json`) and its docs page (`/docs`).

Nothing here is written by hand twice: each view declares what it reads and
answers with `@operation(...)`, naming models from `contract.documents` (the
same ones that validate its input and build its output), and the document is
generated from the app's URL map, its settings and those models the first
time it is asked for, then kept on the app with its JSON and its page as bytes
(nothing it reads changes while the app runs; `published`).

Every blueprint imports this module for `@operation` and its `Reply`s, so it imports no other module of the API's
but the docs page's template: the settings come from `install`, the media types and the problem type from contract/.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from flask import Blueprint, Flask, Response, current_app, render_template_string
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.docs_page import DOCS_TEMPLATE, code_spans, describe_schema
from contract.admission.media import ACCEPTED_TYPES, ACCEPTED_TYPES_TEXT
from contract.callbacks import callback_signature
from contract.documents import PROBLEM_TYPE, ProblemDocument
from contract.jobs.record import JOB_ID_PATTERN
from contract.settings import Settings

blueprint = Blueprint("openapi", __name__)
SETTINGS = "imgserve.openapi.settings"  # the key in app.extensions: the settings the document is built from

SCHEMA_REF = "#/components/schemas/{model}"
TAGS = ("jobs", "models", "stats", "health", "meta")  # the order of the docs page
# Within a tag, the main flow first: submit, read, cancel, then the rest (in path order). /docs listed
# `POST /v1/callbacks/redeliver` first, the path that sorts first, to a reader looking for how to submit.
FLOW = ("/v1/jobs", "/v1/jobs/<job_id>", "/v1/jobs/<job_id>/callback")
METHODS = ("POST", "GET", "PUT", "PATCH", "DELETE")
PROBLEMS = {
    400: "A parameter is invalid (named in `invalid_params`)",
    401: "No or an unknown API key (only when keys are configured)",
    404: "No such job: unknown, made up or mistyped, expired, or another key's (one answer for all)",
    409: "The job already ended",
    413: "The upload is over `api.max_upload_bytes`",
    415: f"The upload is not {ACCEPTED_TYPES_TEXT}",
    429: "Too many jobs, or too many bytes of images, waiting for the model, or this key is over its rate; retry "
    "after `Retry-After` seconds",
    503: "The job store is full, unreachable or refusing, or this process is busy; retry after `Retry-After` seconds",
}
HEADERS = {
    "Location": {"description": "the job's URL", "schema": {"type": "string"}},
    "Content-Location": {
        "description": "the job's URL: the body is the job as a read of it answers",
        "schema": {"type": "string"},
    },
    "Retry-After": {
        "description": "whole seconds to wait before retrying: for a model's backlog or budget, how long its waiting "
        "work takes to drain by enough at the rate its GPU workers answer it now",
        "schema": {"type": "integer"},
    },
}
PATH_PARAMETERS = {
    "job_id": {
        "description": "the `id` the submission answered with",
        "schema": {"type": "string", "pattern": JOB_ID_PATTERN},
    },
}
# Statuses whose problem documents always carry these headers: a 429 or 503 is "not now", and says when.
PROBLEM_HEADERS = {429: ("Retry-After",), 503: ("Retry-After",)}


@dataclass(frozen=True)
class Reply:
    """One documented answer: a model (JSON), or a bare schema for another media type."""

    description: str
    model: type[BaseModel] | None = None
    media_type: str = "application/json"
    schema: dict[str, Any] | None = None
    headers: tuple[str, ...] = ()
    links: dict[str, dict[str, Any]] | None = None  # OpenAPI links: what a client can do next


@dataclass(frozen=True)
class Operation:
    summary: str
    tag: str
    replies: dict[int, Reply]
    problems: tuple[int | tuple[int, str], ...] = ()  # a status, or (status, what it means here)
    description: str = ""
    query: Callable[[Settings], type[BaseModel]] | None = None
    body: Callable[[Settings], dict[str, Any]] | None = None
    public: bool = False  # open even when API keys are configured


def operation(summary: str, *, tag: str, replies: dict[int, Reply], **details: Any) -> Callable:
    """Declare a view's place in the OpenAPI document."""
    declared = Operation(summary=summary, tag=tag, replies=replies, **details)

    def mark(view: Callable) -> Callable:
        view.openapi = declared  # type: ignore[attr-defined]
        return view

    return mark


def install(app: Flask, settings: Settings) -> None:
    """Serve /openapi.json and /docs on `app`, their document built from `settings` on first use."""
    app.extensions[SETTINGS] = settings
    app.register_blueprint(blueprint)


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
    settings: Settings = app.extensions[SETTINGS]
    registry = _SchemaRegistry()
    paths: dict[str, dict[str, Any]] = {}
    declared_rules = [
        (rule, getattr(app.view_functions[rule.endpoint], "openapi", None)) for rule in app.url_map.iter_rules()
    ]
    for rule, declared in sorted(
        ((r, d) for r, d in declared_rules if d is not None),
        key=lambda item: (TAGS.index(item[1].tag), _flow_rank(item[0].rule), item[0].rule),
    ):
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}, key=_method_rank):
            paths.setdefault(path, {})[method.lower()] = _render(
                declared, rule.arguments, settings, registry, f"{rule.endpoint}.{method.lower()}"
            )
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "imgserve", "version": service_version(), "description": DESCRIPTION},
        "paths": paths,
        "x-callback-signature": callback_signature.described(),
        "components": {"schemas": registry.resolve()},
    }
    if settings.auth.api_keys:
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return document


def _flow_rank(rule: str) -> int:
    return FLOW.index(rule) if rule in FLOW else len(FLOW)


def _method_rank(method: str) -> tuple[int, str]:
    return (METHODS.index(method) if method in METHODS else len(METHODS), method)


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


DESCRIPTION = f"""\
Object detection as a service that keeps the GPU fed.

Submit an image with `POST /v1/jobs` (the raw body, or a multipart form with an `image` field): the answer is
`202` with the job's id and a `Location`. Then read `GET /v1/jobs/{{job_id}}`; add `?wait=20` to long-poll until
the job ends. Or in one call: `POST /v1/jobs?wait=20` answers `200` with the finished job when it ends within
those seconds (`202` as above when it has not). A job ends `succeeded` (with `result.detections` in the original image's pixels), `failed`,
`expired` (past its `deadline_ms`) or `cancelled`. `timings_ms` is the job's time bill: how long each stage took.

With `callback_url`, the job document is also POSTed there once it ends, signed:
{callback_signature.formula()} (`x-callback-signature` gives it part by part).

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
    serves), on first use: anyone may ask for it without a key, and rendering it on each call let unauthenticated
    clients slow everyone's (docs/benchmarks/2026-12-05-hostile-api.md, "/docs, open to all")."""
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
