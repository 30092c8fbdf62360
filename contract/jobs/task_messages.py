"""The Celery tasks the processes exchange: their names, their queues, and the preprocess message as it lies in Redis.

The API pushes each job's preprocess task itself, in the Redis transaction that stores the job (one round trip,
all or nothing), so it needs the message's exact form but no Celery app; the CPU and callback workers (tasks/)
register their tasks under these names and route them to these queues.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid

from contract.redis.keys import CALLBACK_QUEUE, PREPROCESS_QUEUE

PREPROCESS_TASK = "imgserve.preprocess"
CALLBACK_TASK = "imgserve.callback"
# Each task's queue when nothing else is said (a job's preprocess task goes to its model's: Keys.preprocess_queue).
TASK_QUEUES = {PREPROCESS_TASK: PREPROCESS_QUEUE, CALLBACK_TASK: CALLBACK_QUEUE}

_NODE_ID = uuid.uuid4().int  # kombu's node id: random, once per process


def reply_address(owner: object) -> str:
    """Where a task's result would be sent: what Celery's `app.oid` is for an app (kombu's oid_from without the
    thread), a UUID of this process and `owner`. No result is ever read (task_ignore_result), but Celery's own
    message carries one, and workers and Flower must not tell the two apart."""
    return str(uuid.uuid3(uuid.NAMESPACE_OID, f"{_NODE_ID:x}-{os.getpid():x}-0-{id(owner):x}"))


class PreprocessMessages:
    """The message Celery's `send_task` would publish for a job's preprocess task, built here.

    Celery's publisher costs the API CPU a job (routing, argument reprs, kombu's producer, its connection
    pool) for what is one LPUSH of a small JSON envelope onto the queue's list (kombu's
    Redis transport, anonymous exchange, priority 0). This builds the same envelope: Celery's task
    protocol 2 with a JSON body, base64-encoded as kombu's transport encodes it; a test compares it with
    Celery's own, field by field, and the pipeline tests have real workers consume it. Flower sees the
    task as before (from the workers' events: the API never sent a task-sent event).
    """

    def __init__(self) -> None:
        self.reply_to = reply_address(self)
        self.origin = f"gen{os.getpid()}@{socket.gethostname()}"

    def build(self, job_id: str, queue: str) -> bytes:
        # The task's id is the job's: Flower finds a job's task by the id a client holds (/task/<job id>). A
        # job sent again (tasks.hop.lost_deliveries) is the same task to Flower, its latest attempt shown; each
        # message still has its own delivery tag.
        task_id = job_id
        body = json.dumps([[job_id], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
        return json.dumps(
            {
                "body": base64.b64encode(body.encode()).decode(),
                "content-encoding": "utf-8",
                "content-type": "application/json",
                "headers": {
                    "lang": "py",
                    "task": PREPROCESS_TASK,
                    "id": task_id,
                    "shadow": None,
                    "eta": None,
                    "expires": None,
                    "group": None,
                    "group_index": None,
                    "retries": 0,
                    "timelimit": [None, None],
                    "root_id": task_id,
                    "parent_id": None,
                    "argsrepr": repr([job_id]),
                    "kwargsrepr": "{}",
                    "origin": self.origin,
                    "ignore_result": None,
                    "replaced_task_nesting": 0,
                    "stamped_headers": None,
                    "stamps": {},
                },
                "properties": {
                    "correlation_id": task_id,
                    "reply_to": self.reply_to,
                    "delivery_mode": 2,
                    "delivery_info": {"exchange": "", "routing_key": queue},
                    "priority": 0,
                    "body_encoding": "base64",
                    "delivery_tag": str(uuid.uuid4()),
                },
            }
        ).encode()
