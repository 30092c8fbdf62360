"""Gunicorn for the API. Long-polls hold a connection each, so the server is
sized for concurrent waits (threads), not for CPU: the API does little work."""
import glob
import os
import tempfile

bind = os.environ.get("IMGSERVE_API_BIND", "0.0.0.0:8000")
worker_class = "gthread"
workers = int(os.environ.get("IMGSERVE_API_WORKERS", "2"))
threads = int(os.environ.get("IMGSERVE_API_THREADS", "64"))
timeout = 75             # above the longest long-poll (api.max_wait_s = 30)
graceful_timeout = 35
keepalive = 5
accesslog = "-"

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
    from contract.settings import load_settings

    settings = load_settings()
    if settings.api.metrics_port:
        from app.metrics import serve_on_metrics_port

        serve_on_metrics_port(settings)
        server.log.info("metrics on %s:%d", settings.api.metrics_host, settings.api.metrics_port)


def post_fork(server, worker):
    from contract.logs import configure_logging

    configure_logging("api")


def child_exit(server, worker):
    """Drop a dead worker's live gauges from the multiprocess metrics."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
