"""Celery entry point for CPU workers and Flower:

    celery -A tasks.worker worker -Q preprocess --concurrency 4
    celery -A tasks.flower flower --port 5555   (tasks.flower: the same app, for Flower)

Settings come from IMGSERVE_CONFIG and the environment (contract.settings.config).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import celery.apps.worker as celery_worker_app
from celery import Celery, Task
from celery.exceptions import SecurityWarning
from celery.signals import (
    after_setup_logger,
    celeryd_after_setup,
    celeryd_init,
    worker_ready,
    worker_shutdown,
)

from contract.jobs.task_messages import CALLBACK_TASK, PREPROCESS_TASK
from contract.library import check_library_at_start
from contract.redis.clock import CLOCK
from contract.redis.connection import connect
from contract.redis.keys import CALLBACK_QUEUE, PREPROCESS_QUEUE, Keys
from contract.runtime.logs import JsonFormatter, configure_logging
from contract.runtime.memory import keep_freed_memory
from contract.settings import Settings
from contract.settings.config import load_settings
from tasks.callbacks.delivery import CallbackSender
from tasks.callbacks.relay import OutboxRelay
from tasks.callbacks.slots import TenantSlots
from tasks.decoding.preprocess import Preprocessor
from tasks.hop.autoscale import AUTOSCALER
from tasks.hop.celery_app import make_celery, send_callback
from tasks.hop.event_batching import BatchTaskEvents
from tasks.hop.full_lists import PauseWhileFrameListFull
from tasks.hop.job_sweeps import JobSweeps
from tasks.hop.recovery import HopRecovery

# Before the pool forks: its children inherit the tuned malloc (see contract.runtime.memory).
keep_freed_memory()
log = logging.getLogger(__name__)


class PreprocessTask(Task):
    """The preprocess task's base: Celery makes one task object per process, so the Preprocessor (and its
    Redis connection) is opened once per process, on first use: in a prefork child, after the fork."""

    settings: Settings
    _preprocessor: Preprocessor | None = None

    @property
    def preprocessor(self) -> Preprocessor:
        if self._preprocessor is None:
            client = connect(self.settings, socket_timeout=10.0)
            CLOCK.follow(client)  # this child's: the deadlines and stamps it writes are the service's
            self._preprocessor = Preprocessor(self.settings, client)
        return self._preprocessor


class CallbackTask(Task):
    """The callback task's base: one CallbackSender per process, opened on first use."""

    settings: Settings
    _sender: CallbackSender | None = None

    @property
    def sender(self) -> CallbackSender:
        if self._sender is None:
            client = connect(self.settings, socket_timeout=10.0)
            CLOCK.follow(client)
            self._sender = CallbackSender(self.settings, client)
        return self._sender


def create_worker_app(settings: Settings) -> Celery:
    """The Celery app of the CPU and callback workers: its consumer steps and its two tasks."""
    app = make_celery(settings)
    # `--autoscale=MAX,MIN` (CPU_AUTOSCALE=MIN,MAX): Celery's autoscaler, sized by the product's backlog
    app.conf.worker_autoscaler = AUTOSCALER
    # Each step reads the settings from the app it is given (tasks.hop.celery_app.settings_of).
    app.steps["consumer"].update((PauseWhileFrameListFull, BatchTaskEvents, HopRecovery, JobSweeps))

    @app.task(
        base=PreprocessTask,
        bind=True,
        name=PREPROCESS_TASK,
        acks_late=True,
        reject_on_worker_lost=True,
        settings=settings,
    )
    def preprocess(self: PreprocessTask, job_id: str) -> str:
        outcome = self.preprocessor.run(job_id)
        # A failure's line carries its error code, as the job's document does ("preprocess failed: decode_error").
        code = outcome.error_code
        # The outcome field is the text before a failure's code, as it always was ("skipped (...)" whole).
        kind = outcome.kind.value if code else str(outcome)
        extra = {"job_id": job_id, "outcome": kind, **({"error_code": code} if code else {})}
        (log.warning if code else log.info)("preprocess %s", outcome, extra=extra)
        return str(outcome)

    # acks_late: a worker that dies during a delivery has the task given back (tasks.hop.recovery) and the callback
    # is posted again with the same delivery id (at least once; receivers drop repeats). Retries are not
    # Celery's: the sender schedules them in Redis (tasks.callbacks.delivery.CallbackSender).
    @app.task(
        base=CallbackTask, bind=True, name=CALLBACK_TASK, acks_late=True, reject_on_worker_lost=True, settings=settings
    )
    def deliver_callback(self: CallbackTask, job_id: str) -> str:
        outcome = self.sender.deliver(job_id)
        log.info("callback %s", outcome, extra={"job_id": job_id, "outcome": outcome})
        return outcome

    return app


@dataclass
class ThisWorker:
    """What the signal handlers below share in this worker process: which role it plays, and its relay."""

    role: str = "cpu-worker"
    relay: OutboxRelay | None = None


settings = load_settings()
app = create_worker_app(settings)  # `celery -A tasks.worker` finds it here
this_worker = ThisWorker()


@celeryd_init.connect
def _name_the_role(options: dict | None = None, instance: object = None, **_: object) -> None:
    """Log lines say which worker wrote them: the one on the callbacks queue is the callback worker. From here
    on they are JSON lines (the first ones, Celery's warnings, came as bare text), and Celery's banner is left out
    unless logs.verbose: the worker's "ready." line says it is up."""
    queues = (options or {}).get("queues") or []
    if isinstance(queues, str):
        queues = queues.split(",")
    if list(queues) == [CALLBACK_QUEUE]:
        this_worker.role = "callback-worker"
    configure_logging(this_worker.role, settings.logs)
    if not settings.logs.verbose:
        if instance is not None:
            instance.quiet = True  # type: ignore[attr-defined]  # celery.apps.worker.Worker's: no banner
        # Celery's "running the worker with superuser privileges" is about unpickling as root: these workers
        # accept JSON only (contract.jobs.task_messages; nothing is pickled across processes). Logged when verbose.
        warnings.filterwarnings("ignore", category=SecurityWarning)
        # "worker: Warm shutdown (MainProcess)", written raw from Celery's signal handler among the JSON lines.
        celery_worker_app.safe_say = _say_as_json  # type: ignore[assignment]


def _say_as_json(msg: str, f: object = None) -> None:
    """Celery's own shutdown lines as one JSON line each, like every other line the worker writes. Called from a
    signal handler: formatted here and written with one os.write, no logging handler's lock taken."""
    record = logging.LogRecord("celery.worker", logging.INFO, __file__, 0, msg, (), None)
    os.write(1, (JsonFormatter(this_worker.role).format(record) + "\n").encode())


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


@worker_ready.connect
def _check_the_library(**_: object) -> None:
    """Every worker checks the Redis function library at start (contract.library)."""
    check_library_at_start(connect(settings, socket_timeout=10.0), log)


@worker_ready.connect
def _start_the_relay(**_: object) -> None:
    """The callback worker hands ended jobs' callbacks from the outbox to its own queue."""
    if this_worker.role == "callback-worker":
        client, keys = connect(settings, socket_timeout=10.0), Keys(settings.namespace)
        slots = TenantSlots(client, keys, settings.callbacks.max_per_tenant, settings.callbacks.deadline_s)
        this_worker.relay = OutboxRelay(client, keys, lambda job_id: send_callback(app, job_id), slots)
        this_worker.relay.start()


@worker_shutdown.connect
def _stop_the_relay(**_: object) -> None:
    if this_worker.relay is not None:
        this_worker.relay.stop()


@after_setup_logger.connect
def _keep_json_logs(**_: object) -> None:
    """Celery sets up its own handler at start; put ours back so every line stays JSON. Celery's own
    two INFO lines per task ("received", "succeeded in") go: the task's line says what happened to
    the job, with its id, and the log relay and the workers pay for every line."""
    configure_logging(this_worker.role, settings.logs)
    for name in ("celery.worker.strategy", "celery.app.trace"):
        logging.getLogger(name).setLevel(logging.WARNING)
