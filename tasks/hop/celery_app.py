"""The Celery app of the CPU and callback workers, configured from settings. The tasks' names, queues and the
preprocess message the API pushes itself are contract.jobs.task_messages'."""

from __future__ import annotations

from typing import Any, cast

from celery import Celery

from contract.jobs.task_messages import CALLBACK_TASK, TASK_QUEUES
from contract.redis.keys import CALLBACK_QUEUE, PREPROCESS_QUEUE, Keys
from contract.settings import Settings
from tasks.hop.broker import SENTINEL_TRANSPORT, TRANSPORT, own_the_schemes


class ServiceCelery(Celery):
    """A Celery app that carries the service's settings. The workers' own bootsteps and autoscaler, which Celery
    makes itself with no arguments of ours, read them from the app they are given (`settings_of`), as Celery's own
    steps read `app.conf`; not from `app.conf` itself, which `celery inspect conf` would show, secrets and all."""

    service_settings: Settings


def settings_of(app: Any) -> Settings:
    """The settings of a Celery app that make_celery made."""
    return cast(ServiceCelery, app).service_settings


def make_celery(settings: Settings) -> Celery:
    own_the_schemes()
    app = ServiceCelery("imgserve", broker=settings.broker_url, set_as_current=False)
    app.service_settings = settings
    app.conf.update(
        # Redis, with one client per channel instead of one per operation (see tasks.hop.broker); through the
        # Sentinels of settings.redis when there are any.
        broker_transport=SENTINEL_TRANSPORT if settings.redis.sentinels else TRANSPORT,
        # JSON only: a task carries a job id, never a pickled object.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        # A task is acked after it ran; a child killed mid-task gets its task redelivered.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_time_limit=settings.celery.task_time_limit_s,
        task_default_queue=PREPROCESS_QUEUE,
        task_routes={task: {"queue": queue} for task, queue in TASK_QUEUES.items()},
        # Redis transport: an unacked task comes back after this long; every key Celery keeps lives
        # under the namespace, so deployments sharing a Redis database never take each other's tasks.
        broker_transport_options={
            "visibility_timeout": settings.celery.visibility_timeout_s,
            "global_keyprefix": Keys(settings.namespace).celery_prefix,
            # One list a queue: no task is sent a priority, and each further step was a key more in every take
            # and BRPOP (tasks.hop.broker).
            "priority_steps": [0],
            **sentinel_options(settings),
        },
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=settings.redis.timeout_s,
        # Flower shows tasks from the workers' events; the API's own "sent" event per task only doubled
        # the events (and Flower's and Redis's work) for a state Flower shows anyway ("received").
        worker_send_task_events=True,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
    )
    return app


def sentinel_options(settings: Settings) -> dict[str, object]:
    """kombu's Sentinel transport options: the service's name, and the Sentinels' own password and timeouts."""
    if not settings.redis.sentinels:
        return {}
    own: dict[str, object] = {
        "socket_connect_timeout": settings.redis.timeout_s,
        "socket_timeout": settings.redis.timeout_s,
    }
    if settings.redis.sentinel_password:
        own["password"] = settings.redis.sentinel_password
    return {"master_name": settings.redis.service, "sentinel_kwargs": own}


def callback_task_id(job_id: str) -> str:
    """A callback delivery's Celery task id: the job id, and what it is (the job id alone is its preprocess
    task's), so Flower's search by the job id finds both."""
    return f"{job_id}-callback"


def send_callback(app: Celery, job_id: str) -> None:
    """Queue one job's callback delivery on its own queue (a slow receiver slows nothing else)."""
    app.send_task(CALLBACK_TASK, args=[job_id], queue=CALLBACK_QUEUE, task_id=callback_task_id(job_id))
