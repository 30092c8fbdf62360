"""The CPU worker's own bootsteps read the service's settings from the app Celery gives them
(tasks.hop.celery_app.settings_of), and the settings stay out of the app's conf, which any client of the broker can ask
a worker for (`celery inspect conf`, Flower's worker page). A real stack's CPU worker."""

from __future__ import annotations

import json

import pytest

from contract.redis.clock import now as service_now
from tasks.hop.celery_app import make_celery, settings_of
from tests.support import wait_until

pytestmark = pytest.mark.integration


def test_the_steps_run_on_the_apps_settings_which_the_workers_conf_does_not_show(stack) -> None:
    app = make_celery(stack.settings)
    assert settings_of(app) is stack.settings

    # HopRecovery beats under the app's namespace: the worker is in the registry, its heartbeat fresh.
    def registered() -> list[bytes]:
        return [
            worker
            for worker in stack.redis.zrange(stack.keys.cpu_workers, 0, -1)
            if stack.redis.exists(stack.keys.cpu_heartbeat(worker.decode()))
        ]

    wait_until(registered, timeout_s=30, what="the CPU worker registered, its heartbeat live")
    newest = max(score for _, score in stack.redis.zrange(stack.keys.cpu_workers, 0, -1, withscores=True))
    assert service_now() - newest < 3 * stack.settings.celery.heartbeat_ttl_s

    replies = app.control.inspect(timeout=10.0).conf(with_defaults=False)
    assert replies, "the CPU worker answered no `inspect conf`"
    shown = json.dumps(replies, default=str)
    assert "service_settings" not in shown and "Settings(" not in shown
    assert all(reply.get("worker_autoscaler") == "tasks.hop.autoscale:BacklogAutoscaler" for reply in replies.values())
