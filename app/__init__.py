"""The REST API: `create_app(settings)` builds one Flask app with its own
Redis client, Celery sender and long-poll listener: no module globals.

    gunicorn -c configs/gunicorn.conf.py 'app:create_app()'
"""
from __future__ import annotations

import io
import time
from dataclasses import dataclass

import kombu.exceptions
import redis
from flask import Flask, Request, g
from werkzeug.exceptions import HTTPException

from app import auth, health, jobs, metrics, openapi, stats
from app.problems import Problem, problem_response
from app.waiters import JobEventListener
from contract.connection import connect
from contract.jobs import JobStore
from contract.keys import Keys
from contract.models import Catalogue
from contract.settings import Settings, load_settings
from tasks.celery_app import PreprocessMessages, make_celery


class InMemoryFormRequest(Request):
    """Multipart parts are parsed from the body already read whole into memory (and bounded by
    api.max_upload_bytes): Werkzeug's default spools a part over 500 KB to a temporary file on disk,
    a write and a read back of every photo."""

    def _get_file_stream(self, total_content_length: int | None, content_type: str | None,
                         filename: str | None = None, content_length: int | None = None) -> io.BytesIO:
        return io.BytesIO()


@dataclass
class Services:
    """What the request handlers use, hung on `app.extensions['imgserve']`."""
    settings: Settings
    redis: redis.Redis
    keys: Keys
    store: JobStore
    catalogue: Catalogue
    task_messages: PreprocessMessages   # the CPU task of each job, pushed with the job itself
    listener: JobEventListener


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or load_settings()
    app = Flask(__name__)
    app.request_class = InMemoryFormRequest
    # Werkzeug refuses a larger body from its Content-Length, before reading it.
    app.config["MAX_CONTENT_LENGTH"] = settings.api.max_upload_bytes
    app.config["MAX_FORM_MEMORY_SIZE"] = settings.api.max_upload_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]  # Flask's DefaultJSONProvider has it
    client = connect(settings, socket_timeout=settings.api.redis_timeout_s + 3.0)
    keys = Keys(settings.namespace)
    celery = make_celery(settings)
    app.extensions["imgserve"] = Services(
        settings=settings, redis=client, keys=keys,
        store=JobStore(client, keys, settings.jobs.ttl_s),
        catalogue=Catalogue(settings),
        task_messages=PreprocessMessages(celery),
        # One pub/sub listener per process wakes long-polls (the callback worker relays callbacks).
        listener=JobEventListener(redis.Redis(connection_pool=client.connection_pool), keys.job_events),
    )
    app.register_blueprint(jobs.blueprint)
    app.register_blueprint(health.blueprint)
    if not settings.api.metrics_port:   # otherwise served on an internal port, not here
        app.register_blueprint(metrics.blueprint)
    app.register_blueprint(stats.blueprint)
    app.register_blueprint(openapi.blueprint)
    metrics.install(app)
    auth.install(app)
    _install_error_handlers(app)

    @app.before_request
    def stamp_arrival() -> None:
        g.received_at = time.time()

    app.extensions["imgserve"].listener.start()
    return app


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
    @app.errorhandler(kombu.exceptions.OperationalError)
    def backend_unavailable(exc: Exception):
        return problem_response(Problem(503, "backend-unavailable", "Service unavailable",
                                        f"the job store is unreachable: {type(exc).__name__}",
                                        headers={"Retry-After": "1"}))
