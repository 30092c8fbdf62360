"""Structured logs: one JSON object per line, with the job id on every line
about a job, so one job can be followed through the API, the CPU worker and
the GPU worker (`grep <job-id>` across their logs, or a log pipeline's filter).
A line about one job has `job_id`; the GPU worker's line about a batch lists
its jobs in `job_ids` (one line per batch, not eight, on its hot path).

    log.info("job accepted", extra={"job_id": job_id})
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from contract.settings import LogSettings
from contract.settings.config import log_settings_from

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "role": self.role,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


# Start-up and connection chatter, quiet unless logs.verbose: a start printed about 80 lines before the ready line.
# What stays: each process's own line that it is up ("cpu@host ready.", the API's "listening", the GPU worker's).
QUIET_LOGGERS = {
    "celery.worker.consumer.connection": logging.WARNING,  # "Connected to tasks.hop.broker:Transport://..."
    "celery.worker.consumer.mingle": logging.WARNING,  # "mingle: searching for neighbors", "all alone"
    "kombu.mixins": logging.WARNING,  # Flower's "Connected to redis://..."
    "gunicorn.error": logging.WARNING,  # "Starting gunicorn", "Booting worker", "Worker exiting", ...
    # Flower asks the workers before they are up ("Inspect method stats failed"), and again later by itself.
    "flower.inspector": logging.ERROR,
}


def configure_logging(role: str, logs: LogSettings | None = None) -> None:
    """JSON lines on stderr for this process (`logs.format: text` keeps plain text), the start-up chatter quiet
    unless `logs.verbose`. Called before the
    settings are read (so that their errors are logged too) the environment's IMGSERVE_LOGS__FORMAT and
    IMGSERVE_LOGS__LEVEL decide; called again with the settings' `logs` once they are."""
    if logs is None:
        logs = log_settings_from(os.environ)
    handler = logging.StreamHandler(sys.stderr)
    if logs.format == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {role} %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logs.level.upper())
    logging.captureWarnings(True)  # a library's warnings as log lines too, in this format, not bare stderr
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.NOTSET if logs.verbose else level)
