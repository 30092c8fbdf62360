"""Celery entry point for Flower: `celery -A tasks.flower flower`.

The workers' own app (tasks.worker), on kombu's plain Redis transport. The workers' transport
(tasks.broker) names itself `tasks.broker:Transport` in the broker URL Flower reads, and Flower's Broker
tab knows brokers by that URL's scheme: it answered 404 ("'redis' broker is not supported"). Flower
publishes no task and holds no message, which is all tasks.broker changes, so kombu's own serves it; the
queues it lists are the same keys (global_keyprefix is read from the same transport options).
"""
from __future__ import annotations

from tasks.worker import app

app.conf.broker_transport = None   # the scheme of broker_url (redis://) picks kombu's own transport

__all__ = ["app"]
