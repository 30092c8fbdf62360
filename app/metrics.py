"""Prometheus metrics of the API at /metrics (multiprocess-safe under gunicorn
when PROMETHEUS_MULTIPROC_DIR is set, as the Procfile and compose file do)."""
from __future__ import annotations

import os
import time

from flask import Blueprint, Flask, Response, g, request
from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram,
                               generate_latest, multiprocess)

from app.openapi import Reply, operation

blueprint = Blueprint("metrics", __name__)

REQUESTS = Counter("imgserve_api_requests_total", "API requests", ["method", "route", "status"])
REJECTS = Counter("imgserve_api_rejects_total", "Requests refused with a problem document", ["reason"])
LATENCY = Histogram("imgserve_api_request_seconds", "API request latency (long-polls included)", ["route"])


def install(app: Flask) -> None:
    @app.before_request
    def start_timer() -> None:
        g.metrics_started = time.perf_counter()

    @app.after_request
    def record(response: Response) -> Response:
        route = request.url_rule.rule if request.url_rule else "unmatched"
        REQUESTS.labels(request.method, route, str(response.status_code)).inc()
        LATENCY.labels(route).observe(time.perf_counter() - g.get("metrics_started", time.perf_counter()))
        return response


@blueprint.get("/metrics")
@operation("Prometheus metrics of the API processes", tag="health", public=True,
           replies={200: Reply("Prometheus text format", media_type="text/plain", schema={"type": "string"})})
def expose() -> Response:
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)
