"""The REST API: `create_app(settings)` builds one Flask app with its own
Redis client, task messages (contract.task_messages) and long-poll listener: no module globals.

    gunicorn -c configs/gunicorn.conf.py 'app:create_app()'
"""

from __future__ import annotations

import io
import time

import redis
from flask import Flask, Request, g
from werkzeug.exceptions import HTTPException

from app import auth, callbacks, health, holds, home, jobs, metrics, openapi, stats
from app.admission import Admission
from app.callback_lookups import CallbackLookups
from app.drain import MAX_RETRY_AFTER_S
from app.early_refusal import WaitingQueries, refusing_early
from app.multipart import MAX_PARTS
from app.problems import Problem, problem_response
from app.queries import refuse_unknown_query
from app.services import EXTENSION, Services, services
from app.waiters import JobEventListener
from contract.budget import WaitingBytes
from contract.cache import ResultCache
from contract.clock import CLOCK
from contract.clock import now as service_now
from contract.config import load_settings
from contract.connection import close_idle_connections, connect
from contract.jobs.hits import HitLimits
from contract.jobs.ids import job_ids
from contract.jobs.intake import JobIntake
from contract.keys import Keys
from contract.models import Catalogue
from contract.replication import AnswerNotReplicated, NotReplicated, Replication, Unconfirmed, durable_writes
from contract.settings import Settings
from contract.shards import ShardUnavailable, bulk_plane
from contract.task_messages import PreprocessMessages


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


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or load_settings()
    app = Flask(__name__)
    app.request_class = InMemoryFormRequest
    # Werkzeug refuses a larger body from its Content-Length, before reading it.
    app.config["MAX_CONTENT_LENGTH"] = settings.api.max_upload_bytes
    app.config["MAX_FORM_MEMORY_SIZE"] = settings.api.max_upload_bytes
    app.config["MAX_FORM_PARTS"] = MAX_PARTS  # as app.multipart's own parser: past it, 400 (app.jobs)
    app.json.sort_keys = False  # type: ignore[attr-defined]  # Flask's DefaultJSONProvider has it
    # Bounded, and what a burst opened is closed again once idle (contract.connection.IdleClosingPool).
    client = connect(
        settings,
        socket_timeout=settings.api.redis_timeout_s + 3.0,
        max_connections=max(REDIS_CONNECTIONS, settings.api.threads + 2),
    )  # gthread: one a thread
    # The process's clock reads the primary's (contract.clock: every moment it writes or judges is the service's);
    # measured again on the listener's tick.
    CLOCK.follow(client)
    keys = Keys(settings.namespace)
    # Uploads over a few connections of their own: Redis keeps an upload-sized buffer on each (JobIntake.create).
    uploads = connect(settings, socket_timeout=settings.api.redis_timeout_s + 3.0, max_connections=UPLOAD_CONNECTIONS)
    # With bulk shards (contract.shards) uploads go to them instead, over as few connections in all.
    per_shard = max(2, UPLOAD_CONNECTIONS // max(1, len(settings.bulk.redis_urls)))
    bulk = bulk_plane(settings, client, max_connections=per_shard)
    # With replicas to reach (settings.redis), a 202 waits until they hold the job: contract.connection.
    # Behind Sentinel, every replica the Sentinels see up, on the primary their majority names (contract.replication).
    durable = durable_writes(settings)
    if durable is not None:
        durable.start()
    replication = Replication(settings.redis.replicas_per_write, settings.redis.replica_timeout_ms, durable)
    hits = HitLimits.of(settings)  # each key's cache hits, charged (contract.jobs.hits)
    # Results as stored: a read serves them unparsed (app.job_bodies).
    store = JobIntake(
        client,
        keys,
        settings.jobs.ttl_s,
        uploads=uploads,
        bulk=bulk,
        replication=replication,
        hits=hits,
        results_as_text=True,
    )
    catalogue, cache = Catalogue(settings), ResultCache(client, keys, settings)
    admission = Admission(settings, client, keys, store, catalogue, cache)
    app.extensions[EXTENSION] = Services(
        settings=settings,
        redis=client,
        keys=keys,
        store=store,
        catalogue=catalogue,
        admission=admission,
        task_messages=PreprocessMessages(),
        # One pub/sub listener per process wakes long-polls (the callback worker relays callbacks); each
        # second it also ends the jobs whose deadline passed (the CPU workers do too, more often).
        listener=JobEventListener(
            redis.Redis(connection_pool=client.connection_pool),
            keys.job_events,
            on_tick=_ticks(
                CLOCK.sync_if_due, _sweeper(store, admission.waiting), _idle_closer([client, uploads, *bulk.clients])
            ),
        ),
        cache=cache,
        holds=holds.Holds.of(settings.api),
        callback_lookups=CallbackLookups(
            settings.callbacks.lookup_timeout_s,
            settings.callbacks.max_lookups_per_key,
            settings.callbacks.lookup_threads,
        ),
        job_ids=job_ids(settings),
    )
    app.register_blueprint(jobs.blueprint)
    app.register_blueprint(health.blueprint)
    if not settings.api.metrics_port:  # otherwise served on an internal port, not here
        app.register_blueprint(metrics.blueprint)
    app.register_blueprint(stats.blueprint)
    app.register_blueprint(callbacks.blueprint)
    app.register_blueprint(openapi.blueprint)
    app.register_blueprint(home.blueprint)
    metrics.install(app)
    auth.install(app)
    refuse_unknown_query(app, settings)  # after the key check: a caller without one learns nothing of the routes
    holds.install(app, services(app).holds, keyed=bool(settings.auth.api_keys))  # after auth: per key
    if settings.auth.api_keys:  # a key's long-polls past its bound: refused before Flask (half the CPU)
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

    services(app).listener.start()
    return app


SWEEP_EVERY_S = 1.0
# The HTML pages (/, /docs): their own styles; one script, /docs/try.js from this service (no inline script, none
# from elsewhere), which may fetch from this origin alone (the docs page's "Try it"); no frames.
HTML_POLICY = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; img-src data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
UPLOAD_CONNECTIONS = 8  # per API process: uploads written at once (more wait for one, up to the connect timeout)
# Per API process: Redis round trips in flight at once, the pub/sub listener's connection included (more wait for
# one, up to the connect timeout). Issue 41's burst (40 QPS on 2 cores) left 7 more than its steady load used; 64
# at ~1 ms a round trip is ~60,000 a second, far more than one process's core asks for.
REDIS_CONNECTIONS = 64
# A connection left unused in its pool this long is closed (it reopens when needed): what a burst opened goes.
REDIS_IDLE_S = 60.0
IDLE_CHECK_EVERY_S = 10.0


def _ticks(*ticks):
    def tick() -> None:
        for each in ticks:
            each()

    return tick


def _idle_closer(clients: list[redis.Redis]):
    """The listener's tick: close the connections idle past REDIS_IDLE_S, looked for every IDLE_CHECK_EVERY_S."""
    last = [time.monotonic()]
    distinct = list({id(client.connection_pool): client for client in clients}.values())  # bulk may be the control

    def close_idle() -> None:
        now = time.monotonic()
        if now - last[0] < IDLE_CHECK_EVERY_S:
            return
        last[0] = now
        for client in distinct:
            close_idle_connections(client, REDIS_IDLE_S)

    return close_idle


def _sweeper(store: JobIntake, waiting: WaitingBytes):
    """The listener's tick: end overdue jobs, give back the bytes a refused submission could not (Redis
    was away) and add this process's cache misses to the shared counters, at most once a second."""
    last = [0.0]

    def sweep() -> None:
        now = service_now()
        if now - last[0] < SWEEP_EVERY_S:
            return
        last[0] = now
        try:
            store.expire_overdue(now)
            waiting.flush_unreleased()
            store.flush_counts()
        except redis.RedisError:
            pass  # the listener has lost Redis too, and says so

    return sweep


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
    def backend_unavailable(exc: Exception):
        """Said as it is, with no exception text: full, unreachable, or refusing for another reason."""
        retry = str(services(app).settings.backpressure.retry_after_s)
        if isinstance(exc, AnswerNotReplicated):  # how it ended is not on the replicas yet: ask again
            problem = Problem(
                503,
                "not-replicated",
                "Service unavailable",
                "the job ended, but its end is not yet on enough replicas to be shown; read it again",
                headers={"Retry-After": "1"},
            )
        elif isinstance(exc, NotReplicated):  # stored on the primary only: withdrawn; a retry may well succeed
            problem = Problem(
                503,
                "not-replicated",
                "Service unavailable",
                "the job could not be stored on enough replicas in time and was withdrawn; retry",
                headers={"Retry-After": "1"},
            )
        elif isinstance(exc, ShardUnavailable):  # only this job's shard: the next submit goes to another
            problem = Problem(
                503,
                "shard-unavailable",
                "Service unavailable",
                "the store for this job's upload is unreachable; retry (a new job is placed on another)",
                headers={"Retry-After": "1"},
            )
        elif isinstance(exc, redis.exceptions.OutOfMemoryError):
            problem = Problem(
                503,
                "store-full",
                "Service unavailable",
                "the job store is full; retry later",
                headers={"Retry-After": str(MAX_RETRY_AFTER_S)},
            )
        elif isinstance(exc, Unconfirmed):  # this process cannot tell it writes to the primary that will last
            problem = Problem(
                503,
                "backend-unavailable",
                "Service unavailable",
                "the job store's primary is not confirmed by a majority of its Sentinels; retry",
                headers={"Retry-After": "1"},
            )
        elif isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            problem = Problem(
                503,
                "backend-unavailable",
                "Service unavailable",
                "the job store is unreachable",
                headers={"Retry-After": retry},
            )
        else:
            problem = Problem(
                503,
                "backend-error",
                "Service unavailable",
                "the job store refused the request",
                headers={"Retry-After": retry},
            )
        return problem_response(problem)
