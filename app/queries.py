"""Query parameters no route takes are refused, on every route."""

from __future__ import annotations

from flask import Flask, request

from app.problems import Problem
from contract.settings import Settings

REASON = "not a query parameter of this operation"


def refuse_unknown_query(app: Flask, settings: Settings) -> None:
    """Every route refuses a query parameter it does not take, with a 400 naming it, as POST /v1/jobs always
    did: `GET /v1/jobs/<id>?wiat=10` was read as a plain GET (200 at once, no long-poll, no word why). What a
    route takes is its declared query model's fields (`@operation(query=...)`), the same the docs list."""
    known: dict[str, frozenset[str]] = {}

    @app.before_request
    def check_query() -> None:
        if not request.args or request.endpoint is None:
            return
        names = known.get(request.endpoint)
        if names is None:
            declared = getattr(app.view_functions[request.endpoint], "openapi", None)
            if declared is None:  # not one of the API's routes
                return
            names = frozenset(declared.query(settings).model_fields) if declared.query else frozenset()
            known[request.endpoint] = names
        unknown = sorted(set(request.args) - names)
        if unknown:
            takes = ", ".join(sorted(names)) or "none"
            raise Problem(
                400,
                "invalid-parameter",
                "Invalid parameter",
                "unknown query parameter(s): "
                + ", ".join(repr(name) for name in unknown)
                + f"; {request.method} {request.url_rule} takes {takes}",
                invalid_params=[{"name": name, "reason": REASON} for name in unknown],
            )
