"""The API pushes each job's Celery task itself (contract.jobs.task_messages.PreprocessMessages): it must be the
message Celery's own publisher would have pushed, so that workers and Flower cannot tell them apart."""

from __future__ import annotations

import base64
import dataclasses
import json

import redis

from contract.jobs.task_messages import PREPROCESS_TASK, PreprocessMessages, reply_address
from contract.redis.keys import Keys
from contract.settings.config import load_settings
from tasks.hop.celery_app import make_celery

VARYING = {
    ("headers", "id"),
    ("headers", "root_id"),
    ("properties", "correlation_id"),
    ("properties", "delivery_tag"),
    ("headers", "origin"),
    ("properties", "reply_to"),
}


def _flatten(message: dict, path: tuple = ()) -> dict:
    flat = {}
    for key, value in message.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, (*path, key)))
        else:
            flat[(*path, key)] = value
    return flat


def test_the_message_is_celerys_own_but_for_its_ids(redis_server):
    settings = dataclasses.replace(load_settings(), redis_url=redis_server.url, namespace="task-messages")
    keys = Keys(settings.namespace)
    app = make_celery(settings)
    queue = keys.preprocess_queue(settings.models[0].key)
    client = redis.Redis.from_url(redis_server.url)
    client.delete(keys.celery_queue(queue))
    app.send_task(PREPROCESS_TASK, args=["a" * 32], queue=queue, task_id="a" * 32)  # Celery's own message
    celerys = json.loads(client.rpop(keys.celery_queue(queue)))
    ours = json.loads(PreprocessMessages().build("a" * 32, queue))

    theirs_flat, ours_flat = _flatten(celerys), _flatten(ours)
    assert theirs_flat.keys() == ours_flat.keys()
    assert {k: v for k, v in ours_flat.items() if k not in VARYING} == {
        k: v for k, v in theirs_flat.items() if k not in VARYING
    }
    assert ours["headers"]["task"] == PREPROCESS_TASK and ours["properties"]["delivery_info"]["routing_key"] == queue
    assert json.loads(base64.b64decode(ours["body"]))[0] == ["a" * 32]
    assert ours["headers"]["root_id"] == ours["headers"]["id"] == ours["properties"]["correlation_id"]
    assert ours["headers"]["origin"].split("@")[0].startswith("gen")
    # The task id is the job id (Flower finds a job by it), in both; each message has its own delivery tag.
    assert ours["headers"]["id"] == celerys["headers"]["id"] == "a" * 32
    again = json.loads(PreprocessMessages().build("a" * 32, queue))
    assert again["headers"]["id"] == ours["headers"]["id"]
    assert again["properties"]["delivery_tag"] != ours["properties"]["delivery_tag"]


def test_the_reply_address_is_one_uuid_per_sender_in_celerys_form():
    """Celery's app.oid is a version-3 UUID of the process and the app; the API's sender has one of its own."""
    import uuid

    from celery import Celery

    messages = PreprocessMessages()
    address = json.loads(messages.build("a" * 32, "preprocess"))["properties"]["reply_to"]
    assert address == json.loads(messages.build("b" * 32, "preprocess"))["properties"]["reply_to"]
    assert uuid.UUID(address).version == uuid.UUID(Celery(set_as_current=False).oid).version == 3
    assert reply_address(object()) != address
