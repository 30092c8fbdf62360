"""Gunicorn for the API. Long-polls hold a connection each, so the server is
sized for concurrent waits (threads), not for CPU: the API does little work."""
import os

bind = os.environ.get("IMGSERVE_API_BIND", "0.0.0.0:8000")
worker_class = "gthread"
workers = int(os.environ.get("IMGSERVE_API_WORKERS", "2"))
threads = int(os.environ.get("IMGSERVE_API_THREADS", "64"))
timeout = 75             # above the longest long-poll (api.max_wait_s = 30)
graceful_timeout = 35
keepalive = 5
accesslog = "-"


def post_fork(server, worker):
    from contract.logs import configure_logging

    configure_logging("api")


def child_exit(server, worker):
    """Drop a dead worker's live gauges from the multiprocess metrics."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
