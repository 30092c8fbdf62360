"""Gunicorn for the API, facing clients directly.

gevent workers: a connection costs a greenlet, not a thread, so long-polls
and slow clients are cheap, and a request's headers must arrive within
`keepalive` seconds (gunicorn bounds each header read by it) or the connection
is dropped: a few hundred half-sent requests (slowloris) no longer take every
thread while /healthz waits. `api.worker_class: gthread` (IMGSERVE_API__WORKER_CLASS=gthread) restores the
threaded worker (`api.threads` each). Every value here comes from the settings' `api` section."""

import glob
import os
import tempfile

from contract.runtime.memory import keep_freed_memory
from contract.settings.config import load_settings

# In the master, before it forks the workers: they inherit the tuned malloc (see contract.runtime.memory).
keep_freed_memory()

_settings = load_settings()  # read once: the hooks below use it too
_api = _settings.api
bind = _api.bind
# gevent, with gunicorn's own error answers (bad request line, URI too long) as problem+json.
worker_class = _api.worker_class
workers = _api.workers
worker_connections = _api.connections  # per worker, gevent
threads = _api.threads  # per worker, gthread
timeout = 75  # above the longest long-poll (api.max_wait_s = 30)
graceful_timeout = 35
keepalive = 5  # also the bound on reading a request's headers (gevent)
# The listen queue (the kernel caps it at net.core.somaxconn; gunicorn's default is 2048): 4,000 connections opened
# at once overflowed 2048, and a connection dropped there (a /healthz probe's too) is retried by its client's
# kernel 1, 3, 7 s later. Queued, each waits for those ahead of it: ~2,000 a second are refused here.
backlog = 4096
limit_request_line = 8190
limit_request_fields = 60
limit_request_field_size = 8190
# No forwarded SCRIPT_NAME or PATH_INFO: gunicorn takes them from any client on forwarded_allow_ips (127.0.0.1 and ::1
# by default), and a SCRIPT_NAME the path does not start with was a 500 (issue 59). The API is served at the root,
# facing clients directly; a header with an underscore is then dropped (header_map "drop"). A proxy's
# X-Forwarded-Proto is still read from those addresses (secure_scheme_headers).
forwarder_headers = ""
# One line per request on top of the API's own JSON lines (a job's are "job accepted" and its reads'
# errors) cost the API and the log relay as much as a fifth of a submission: on when asked for.
accesslog = _api.access_log or None
# Its own lines as JSON, and only its warnings and errors unless logs.verbose (app.server.JsonLogger); the API
# says it is up in one line of its own (when_ready).
logger_class = "app.server.JsonLogger"
# No control socket: nothing here uses gunicornc, and its default path (~/.gunicorn/gunicorn.ctl) is one per
# user, so a second API on the machine (a test stack, a second checkout) removed the first one's.
control_socket_disable = True

# Several worker processes: their metrics must be collected across processes, whoever is scraped.
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="imgserve-metrics-"))


def on_starting(server):
    """Start from zero: files left by a previous run's processes would be summed in."""
    metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    os.makedirs(metrics_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(metrics_dir, "*.db")):
        os.remove(stale)


def when_ready(server):
    """With `api.metrics_port` set, /metrics is served by the master there, and not on `bind`."""
    import logging

    from contract.runtime.logs import configure_logging

    configure_logging("api", _settings.logs)
    metrics = ""
    if _api.metrics_port:
        from app.metrics import serve_on_metrics_port

        serve_on_metrics_port(_settings)
        metrics = f"; metrics on {_api.metrics_host}:{_api.metrics_port}"
    logging.getLogger("api").info("listening at %s, %d worker processes%s", _api.bind, _api.workers, metrics)


def post_fork(server, worker):
    from contract.runtime.logs import configure_logging

    configure_logging("api", _settings.logs)


def child_exit(server, worker):
    """Drop a dead worker's live gauges from the multiprocess metrics."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
