"""Celery entry point for CPU workers and Flower:

    celery -A tasks.worker worker -Q preprocess --concurrency 4
    celery -A tasks.worker flower --port 5555

Settings come from IMGSERVE_CONFIG / IMGSERVE_REDIS_URL (see contract.settings).
"""
from __future__ import annotations

import logging

from celery.signals import (
    after_setup_logger,
    celeryd_after_setup,
    celeryd_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
)

from contract.config import load_settings
from contract.connection import connect
from contract.keys import CALLBACK_QUEUE, PREPROCESS_QUEUE, Keys
from contract.logs import configure_logging
from contract.memory import keep_freed_memory
from tasks.callback_relay import OutboxRelay
from tasks.callbacks import CallbackSender
from tasks.celery_app import CALLBACK_TASK, PREPROCESS_TASK, make_celery, send_callback
from tasks.event_batching import batch_task_events
from tasks.full_lists import pause_while_full
from tasks.liveness import keep_alive
from tasks.preprocess import Preprocessor

# Before the pool forks: its children inherit the tuned malloc (see contract.memory).
keep_freed_memory()
settings = load_settings()
app = make_celery(settings)
app.steps["consumer"].add(pause_while_full(settings))
app.steps["consumer"].add(batch_task_events(settings))
app.steps["consumer"].add(keep_alive(settings))
log = logging.getLogger(__name__)

_preprocessor: Preprocessor | None = None
_role = "cpu-worker"


@celeryd_init.connect
def _name_the_role(options: dict | None = None, **_: object) -> None:
    """Log lines say which worker wrote them: the one on the callbacks queue is the callback worker."""
    global _role
    queues = (options or {}).get("queues") or []
    if isinstance(queues, str):
        queues = queues.split(",")
    if list(queues) == [CALLBACK_QUEUE]:
        _role = "callback-worker"


@celeryd_after_setup.connect
def _consume_every_model_queue(sender: str, instance: object, **_: object) -> None:
    """`-Q preprocess` means every model's CPU queues (Keys.preprocess_queue: one per API key too) as well as
    the plain one (jobs queued before models had queues). The worker takes from them round robin, so one
    model's backlog, or one key's, waits behind itself, not in front of another's requests."""
    queues = app.amqp.queues
    if PREPROCESS_QUEUE in queues.consume_from:
        keys = Keys(settings.namespace)
        for spec in settings.models:
            for queue in keys.preprocess_queues(spec.key, settings.tenants):
                queues.select_add(queue)


_relay: OutboxRelay | None = None


@worker_ready.connect
def _start_the_relay(**_: object) -> None:
    """The callback worker hands ended jobs' callbacks from the outbox to its own queue."""
    global _relay
    if _role == "callback-worker":
        _relay = OutboxRelay(connect(settings, socket_timeout=10.0), Keys(settings.namespace),
                             lambda job_id: send_callback(app, job_id))
        _relay.start()


@worker_shutdown.connect
def _stop_the_relay(**_: object) -> None:
    if _relay is not None:
        _relay.stop()


@after_setup_logger.connect
def _keep_json_logs(**_: object) -> None:
    """Celery sets up its own handler at start; put ours back so every line stays JSON. Celery's own
    two INFO lines per task ("received", "succeeded in") go: the task's line says what happened to
    the job, with its id, and the log relay and the workers pay for every line."""
    configure_logging(_role, settings.logs)
    for name in ("celery.worker.strategy", "celery.app.trace"):
        logging.getLogger(name).setLevel(logging.WARNING)


@worker_process_init.connect
def _open_per_child(**_: object) -> None:
    """Each prefork child opens its own Redis connection after the fork."""
    global _preprocessor
    _preprocessor = Preprocessor(settings, connect(settings, socket_timeout=10.0))


def _get_preprocessor() -> Preprocessor:
    global _preprocessor
    if _preprocessor is None:  # solo/threads pools have no child init
        _preprocessor = Preprocessor(settings, connect(settings, socket_timeout=10.0))
    return _preprocessor


@app.task(name=PREPROCESS_TASK, acks_late=True, reject_on_worker_lost=True)
def preprocess(job_id: str) -> str:
    outcome = _get_preprocessor().run(job_id)
    log.info("preprocess %s", outcome, extra={"job_id": job_id, "outcome": outcome})
    return outcome


_sender: CallbackSender | None = None


# acks_late: a worker that dies during a delivery has the task given back (tasks.liveness) and the callback is
# posted again with the same delivery id (at least once; receivers drop repeats). Retries are not Celery's:
# the sender schedules them in Redis (tasks.callbacks.CallbackSender).
@app.task(name=CALLBACK_TASK, acks_late=True, reject_on_worker_lost=True)
def deliver_callback(job_id: str) -> str:
    global _sender
    if _sender is None:
        _sender = CallbackSender(settings, connect(settings, socket_timeout=10.0))
    outcome = _sender.deliver(job_id)
    log.info("callback %s", outcome, extra={"job_id": job_id, "outcome": outcome})
    return outcome
