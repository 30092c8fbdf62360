"""The Celery app, configured from settings. Imported by the API to send tasks."""
from __future__ import annotations

import base64
import json
import os
import socket
import uuid

from celery import Celery

from contract.keys import CALLBACK_QUEUE, PREPROCESS_QUEUE, Keys
from contract.settings import Settings
from tasks.broker import SENTINEL_TRANSPORT, TRANSPORT

PREPROCESS_TASK = "imgserve.preprocess"
CALLBACK_TASK = "imgserve.callback"


def make_celery(settings: Settings) -> Celery:
    app = Celery("imgserve", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        # Redis, with one client per channel instead of one per operation (see tasks.broker); through the
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
        task_routes={PREPROCESS_TASK: {"queue": PREPROCESS_QUEUE}, CALLBACK_TASK: {"queue": CALLBACK_QUEUE}},
        # Redis transport: an unacked task comes back after this long; every key Celery keeps lives
        # under the namespace, so deployments sharing a Redis database never take each other's tasks.
        broker_transport_options={"visibility_timeout": settings.celery.visibility_timeout_s,
                                  "global_keyprefix": Keys(settings.namespace).celery_prefix,
                                  **sentinel_options(settings)},
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=settings.api.redis_timeout_s,
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
    own: dict[str, object] = {"socket_connect_timeout": settings.api.redis_timeout_s,
                              "socket_timeout": settings.api.redis_timeout_s}
    if settings.redis.sentinel_password:
        own["password"] = settings.redis.sentinel_password
    return {"master_name": settings.redis.service, "sentinel_kwargs": own}


class PreprocessMessages:
    """The message `send_preprocess` would make Celery publish for a job, built here so that the API can
    push it in the same Redis transaction that stores the job (one round trip, all or nothing).

    Celery's publisher costs the API ~0.4 ms of CPU a job (routing, argument reprs, kombu's producer,
    its connection pool) for what is one LPUSH of a small JSON envelope onto the queue's list (kombu's
    Redis transport, anonymous exchange, priority 0). This builds the same envelope: Celery's task
    protocol 2 with a JSON body, base64-encoded as kombu's transport encodes it; a test compares it with
    Celery's own, field by field, and the pipeline tests have real workers consume it. Flower sees the
    task as before (from the workers' events: the API never sent a task-sent event).
    """

    def __init__(self, app: Celery) -> None:
        self.reply_to = app.oid
        self.origin = f"gen{os.getpid()}@{socket.gethostname()}"

    def build(self, job_id: str, queue: str) -> bytes:
        task_id = str(uuid.uuid4())
        body = json.dumps([[job_id], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
        return json.dumps({
            "body": base64.b64encode(body.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"lang": "py", "task": PREPROCESS_TASK, "id": task_id, "shadow": None, "eta": None,
                        "expires": None, "group": None, "group_index": None, "retries": 0,
                        "timelimit": [None, None], "root_id": task_id, "parent_id": None,
                        "argsrepr": repr([job_id]), "kwargsrepr": "{}", "origin": self.origin,
                        "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {}},
            "properties": {"correlation_id": task_id, "reply_to": self.reply_to, "delivery_mode": 2,
                           "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
                           "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
        }).encode()


def send_preprocess(app: Celery, job_id: str, queue: str) -> None:
    """Queue one job for a CPU worker on its model's queue (Keys.preprocess_queue); fails fast when the
    broker is down."""
    app.send_task(PREPROCESS_TASK, args=[job_id], queue=queue,
                  retry=True, retry_policy={"max_retries": 1, "interval_start": 0.1})


def send_callback(app: Celery, job_id: str) -> None:
    """Queue one job's callback delivery on its own queue (a slow receiver slows nothing else)."""
    app.send_task(CALLBACK_TASK, args=[job_id], queue=CALLBACK_QUEUE)
