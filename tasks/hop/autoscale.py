"""Celery's own pool autoscaler, steered by the product's backlog instead of the tasks one node has reserved
. `CPU_AUTOSCALE=MIN,MAX make run` (and compose's) starts the CPU worker with `--autoscale=MAX,MIN`; the
Celery app names this class as its `worker_autoscaler`.

Celery's Autoscaler sizes a node's pool from `len(state.reserved_requests)`: only what that node prefetched, so a
backlog queued behind a full prefetch never grows it, and with several nodes each sees its own share. Here the
wanted size is contract.workers.scaling's `pool_wanted`: the unrounded wants of the models this node takes, summed,
divided among the CPU worker nodes that autoscale (each says so in `Keys.cpu_autoscalers` at every look), rounded up
once and clamped to MIN..MAX (idle models want none: the pool goes back to MIN). It looks every LOOK_EVERY_S and with
task messages (Celery's own timer ran every `keepalive`, 30 s: a shorter burst went unseen); the rest is Celery's: no
shrink until AUTOSCALE_KEEPALIVE (30 s) after the last growth or task, and a shrink that retires only idle children
(billiard's Pool.shrink refuses busy ones: no task is killed, none redelivered).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery.worker.autoscale import Autoscaler

from contract.redis.clock import now as service_now
from contract.redis.connection import connect
from contract.redis.keys import Keys
from contract.settings import Settings
from contract.workers.scaling import backlogs, gpu_windows, pool_wanted, scaling_signal
from tasks.hop.broker import holder_id
from tasks.hop.celery_app import settings_of

log = logging.getLogger(__name__)

AUTOSCALER = "tasks.hop.autoscale:BacklogAutoscaler"  # the Celery app's worker_autoscaler
LOOK_EVERY_S = 0.5  # the signal is read this often (Celery's timer), and at most this often with task messages
NODE_FRESH_S = 90.0  # a node that looked within this long counts among those sharing the wanted processes


class BacklogAutoscaler(Autoscaler):
    """Celery's Autoscaler whose wanted pool size is this node's share of the product's signal."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Celery's `keepalive` is both how often its event loop asks (a timer) and how long a pool stays grown:
        # here it looks every LOOK_EVERY_S (a burst that ends within Celery's 30 s would go unseen) and shrinks
        # after the same delay as Celery's (AUTOSCALE_KEEPALIVE).
        self.shrink_after_s: float = float(self.keepalive)  # type: ignore[has-type]  # Celery sets it untyped
        self.keepalive = LOOK_EVERY_S
        log.info("autoscaling on the backlog: %d..%d processes", self.min_concurrency, self.max_concurrency)
        # Celery makes it, given the worker: the settings are those of the worker's app, as for the bootsteps.
        self.settings: Settings = settings_of(self.worker.app)
        self.keys = Keys(self.settings.namespace)
        self._client: redis.Redis | None = None
        self._wanted = self.min_concurrency
        self._looked_at = 0.0

    @property
    def qty(self) -> int:  # what Celery's _maybe_scale compares the pool with
        if time.monotonic() - self._looked_at >= LOOK_EVERY_S:
            self._looked_at = time.monotonic()
            try:
                wanted = self.wanted()
            except redis.RedisError as exc:  # Redis away: keep the last size; the consumer says why
                log.debug("autoscale: %s", exc)
            else:
                if wanted != self._wanted:
                    log.info(
                        "the backlog wants %d CPU worker processes of this node (it runs %d, %d..%d)",
                        wanted,
                        self.processes,
                        self.min_concurrency,
                        self.max_concurrency,
                        extra={"wanted": wanted, "processes": self.processes},
                    )
                self._wanted = wanted
        return self._wanted

    def scale_down(self, n: int) -> Any:
        """Celery's scale_down, with its delay apart from how often it looks: no shrink until shrink_after_s after
        the last growth or task."""
        last_active = max(filter(None, (self._last_scale_up, self._last_task_received)), default=None)
        if last_active is not None and time.monotonic() - last_active > self.shrink_after_s:
            return self._shrink(n)
        return None

    def models_taken(self) -> list[str]:
        """The models whose CPU queues this node takes (all of them unless its queues say otherwise)."""
        specs = [spec.key for spec in self.settings.models]
        consumer = getattr(self.worker, "consumer", None)
        queues = getattr(getattr(getattr(consumer, "app", None), "amqp", None), "queues", None)
        names = set(getattr(queues, "consume_from", {}) or {})
        taken = [key for key in specs if any(self.keys.preprocess_queue(key) in name for name in names)]
        return taken or specs

    def wanted(self) -> int:
        """This node's share of the processes the models it takes want (contract.workers.scaling), now."""
        if self._client is None:
            self._client = connect(self.settings, socket_timeout=2.0)
        client, keys = self._client, self.keys
        now = service_now()
        pipe = client.pipeline(transaction=False)
        pipe.zadd(keys.cpu_autoscalers, {holder_id(): now})
        pipe.zremrangebyscore(keys.cpu_autoscalers, "-inf", now - NODE_FRESH_S)
        pipe.zcard(keys.cpu_autoscalers)
        nodes = max(1, int(pipe.execute()[-1]))
        models = self.models_taken()
        found = backlogs(client, keys, models, self.settings.tenants)
        windows = gpu_windows(client, keys, self.settings.gpu_worker.heartbeat_ttl_s)
        signals = [scaling_signal(found[model], windows.get(model, []), self.settings.scaling) for model in models]
        return pool_wanted(signals, nodes, self.min_concurrency, self.max_concurrency)
