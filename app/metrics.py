"""Prometheus metrics of the API (multiprocess-safe under gunicorn when
PROMETHEUS_MULTIPROC_DIR is set, as scripts/run-local and the image do): at
/metrics on the API's port, or only on `api.metrics_port` when one is set."""

from __future__ import annotations

import os
import time
from wsgiref.simple_server import WSGIServer

from flask import Blueprint, Flask, Response, g, has_request_context, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
    start_http_server,
)

from app.openapi import Reply, operation
from contract.settings import Settings

blueprint = Blueprint("metrics", __name__)

REQUESTS = Counter("imgserve_api_requests_total", "API requests", ["method", "route", "status"])
# `reason` is the problem's slug, as before; `status` and `route` (the route's rule, as in REQUESTS) tell a refused
# submission (429/503 on /v1/jobs) from a read of an unknown job (404) or a wrong method (405): the alert on
# refused work reads only the former.
REJECTS = Counter(
    "imgserve_api_rejects_total", "Requests refused with a problem document", ["reason", "status", "route"]
)
# `cell`: the cell the job or lookup was in (docs/cells.md; `default` without cells)
SUBMITTED = Counter(
    "imgserve_api_jobs_submitted_total",
    "Jobs accepted, by the model version they were routed to and their cell",
    ["model", "version", "cell"],
)
CACHE_LOOKUPS = Counter(
    "imgserve_api_cache_lookups_total",
    "Result-cache lookups by model version, result (hit, miss) and cell; the hit rate is hits over both",
    ["model", "version", "result", "cell"],
)
# Per cell (docs/cells.md; a deployment without cells has one, `default`): where accepted jobs went, and the
# submissions a cell's Redis did not answer (each then tried on another cell, or refused with none left).
CELL_SUBMITTED = Counter("imgserve_api_cell_jobs_submitted_total", "Jobs accepted, by the cell they went to", ["cell"])
CELL_UNANSWERED = Counter(
    "imgserve_api_cell_unanswered_total", "Submissions whose cell's Redis did not answer, by that cell", ["cell"]
)
LATENCY = Histogram("imgserve_api_request_seconds", "API request latency (long-polls included)", ["route"])

# Labels come from a closed set: each new value is a new series in every scrape (and in the multiprocess mmap
# files), and anyone may send any method to any path: an open set would let them grow the scrape without bound
# (docs/benchmarks/2026-12-05-hostile-api.md).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER = "other"  # any other method; a path that is no route of the API


def method_label(method: str) -> str:
    return method if method in METHODS else OTHER


def request_route() -> str:
    """The rule of the route this request matched (the label REQUESTS and REJECTS carry), or `other`."""
    return request.url_rule.rule if has_request_context() and request.url_rule else OTHER


def count_reject(reason: str, status: int, route: str) -> None:
    REJECTS.labels(reason, str(status), route).inc()


def install(app: Flask) -> None:
    @app.before_request
    def start_timer() -> None:
        g.metrics_started = time.perf_counter()

    @app.after_request
    def record(response: Response) -> Response:
        route = request_route()
        taken_s = time.perf_counter() - g.get("metrics_started", time.perf_counter())
        REQUESTS.labels(method_label(request.method), route, str(response.status_code)).inc()
        LATENCY.labels(route).observe(taken_s)
        # The API's own time for this request (a long-poll's wait included), as browsers' tools and the bench
        # read it: what the client sees beyond it is the network and the HTTP server.
        response.headers["Server-Timing"] = f"app;dur={taken_s * 1000.0:.2f}"
        return response


@blueprint.get("/metrics")
@operation(
    "Prometheus metrics of the API processes (with API keys, for an admin key; or set api.metrics_port)",
    tag="health",
    problems=((403, "API keys are configured and this one is not an admin key"),),
    replies={200: Reply("Prometheus text format", media_type="text/plain", schema={"type": "string"})},
)
def expose() -> Response:
    # Job counts and cache hits of every tenant: with keys, an admin key's (app.auth refuses any other).
    return Response(generate_latest(api_registry()), mimetype=CONTENT_TYPE_LATEST)


def api_registry() -> CollectorRegistry:
    """Every API process's metrics under gunicorn (multiprocess mode), else this process's."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def serve_on_metrics_port(settings: Settings) -> WSGIServer:
    """The internal metrics listener; gunicorn's master starts it (configs/gunicorn.conf.py)."""
    server, _thread = start_http_server(settings.api.metrics_port, settings.api.metrics_host, registry=api_registry())
    return server
