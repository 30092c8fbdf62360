"""The REST API: `create_app(settings)` builds one Flask app with its own Redis clients, task messages
(contract.jobs.task_messages) and long-poll listeners, per cell (app.cells): no module globals.

    gunicorn -c configs/gunicorn.conf.py 'app:create_app()'
"""

from __future__ import annotations

import io
import logging

import redis
from flask import Flask, Request, g
from werkzeug.exceptions import HTTPException

from app import auth, callbacks, health, holds, home, jobs, metrics, openapi, stats
from app.callback_lookups import CallbackLookups
from app.cells import build_cells
from app.early_refusal import WaitingQueries, refusing_early
from app.multipart import MAX_PARTS
from app.problems import Problem, problem_response, redis_problem
from app.queries import refuse_unknown_query
from app.services import EXTENSION, Services, services
from contract.jobs.ids import job_ids
from contract.jobs.task_messages import PreprocessMessages
from contract.library import check_library_at_start
from contract.redis.clock import now as service_now
from contract.settings import Settings
from contract.settings.config import load_settings
from contract.settings.models import Catalogue


class InMemoryFormRequest(Request):
    """Multipart parts are parsed from the body already read whole into memory (and bounded by
    api.max_upload_bytes): Werkzeug's default spools a part over 500 KB to a temporary file on disk,
    a write and a read back of every photo."""

    def _get_file_stream(
        self,
        total_content_length: int | None,
        content_type: str | None,
        filename: str | None = None,
        content_length: int | None = None,
    ) -> io.BytesIO:
        return io.BytesIO()


log = logging.getLogger("app")


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or load_settings()
    app = Flask(__name__)
    app.request_class = InMemoryFormRequest
    # Werkzeug refuses a larger body from its Content-Length, before reading it.
    app.config["MAX_CONTENT_LENGTH"] = settings.api.max_upload_bytes
    app.config["MAX_FORM_MEMORY_SIZE"] = settings.api.max_upload_bytes
    app.config["MAX_FORM_PARTS"] = MAX_PARTS  # as app.multipart's own parser: past it, 400 (app.jobs)
    app.json.sort_keys = False  # type: ignore[attr-defined]  # Flask's DefaultJSONProvider has it
    catalogue = Catalogue(settings)
    ids = job_ids(settings)
    cells, tier = build_cells(settings, catalogue, ids)
    first = cells.first
    for cell in cells:
        check_library_at_start(cell.redis, log)
    app.extensions[EXTENSION] = Services(
        settings=settings,
        redis=first.redis,
        keys=first.keys,
        store=first.store,
        catalogue=catalogue,
        admission=first.admission,
        task_messages=PreprocessMessages(),
        listener=first.listener,
        cache=first.cache,
        holds=holds.Holds.of(settings.api),
        callback_lookups=CallbackLookups(
            settings.callbacks.lookup_timeout_s,
            settings.callbacks.max_lookups_per_key,
            settings.callbacks.lookup_threads,
        ),
        job_ids=ids,
        cells=cells,
        tier=tier,
    )
    app.register_blueprint(jobs.blueprint)
    app.register_blueprint(health.blueprint)
    if not settings.api.metrics_port:  # otherwise served on an internal port, not here
        app.register_blueprint(metrics.blueprint)
    app.register_blueprint(stats.blueprint)
    app.register_blueprint(callbacks.blueprint)
    openapi.install(app, settings)
    app.register_blueprint(home.blueprint)
    metrics.install(app)
    auth.install(app)
    refuse_unknown_query(app, settings)  # after the key check: a caller without one learns nothing of the routes
    holds.install(app, services(app).holds, keyed=bool(settings.auth.api_keys))  # after auth: per key
    if settings.auth.api_keys:  # a key's long-polls past its bound: refused before Flask (cheaper)
        app.wsgi_app = refusing_early(  # type: ignore[method-assign]
            app.wsgi_app, services(app).holds, settings.auth.api_keys, WaitingQueries.of(settings)
        )
    _install_error_handlers(app)

    @app.before_request
    def stamp_arrival() -> None:
        g.received_at = service_now()

    @app.after_request
    def guard_headers(response):
        """No answer is read as anything but its type; the HTML page runs nothing and frames nowhere."""
        response.headers["X-Content-Type-Options"] = "nosniff"
        if response.mimetype == "text/html":
            response.headers["Content-Security-Policy"] = HTML_POLICY
            response.headers["X-Frame-Options"] = "DENY"
            response.headers["Referrer-Policy"] = "no-referrer"
        return response

    for cell in cells:
        cell.listener.start()
    return app


# The HTML pages (/, /docs): their own styles; one script, /docs/try.js from this service (no inline script, none
# from elsewhere), which may fetch from this origin alone (the docs page's "Try it"); no frames.
HTML_POLICY = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; img-src data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def _install_error_handlers(app: Flask) -> None:
    app.register_error_handler(Problem, problem_response)

    @app.errorhandler(HTTPException)
    def http_problem(exc: HTTPException):
        slug = (exc.name or "error").lower().replace(" ", "-")
        detail = exc.description or exc.name
        if exc.code == 413:
            detail = f"the upload exceeds the limit of {app.config['MAX_CONTENT_LENGTH']} bytes"
        # Keep what the exception says in headers: Allow on a 405, WWW-Authenticate on a 401.
        headers = {name: value for name, value in exc.get_headers() if name.lower() != "content-type"}
        return problem_response(Problem(exc.code or 500, slug, exc.name, detail, headers=headers))

    @app.errorhandler(redis.RedisError)
    def backend_unavailable(exc: redis.RedisError):
        """Said as it is, with no exception text (app.problems' REDIS_PROBLEMS)."""
        return problem_response(redis_problem(exc, services(app).settings.backpressure.retry_after_s))
