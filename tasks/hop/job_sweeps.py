"""The jobs' sweeps on each Celery worker: jobs past their deadline end `expired`, and those a lost bulk shard
took with it end too.

Every CPU and callback worker's main process:

- every `celery.sweep_s`, on its own event loop, ends `expired` the jobs whose deadline has passed
  (contract.jobs.expiry.sweep);
- with bulk shards, looks at each shard as often, on a thread of its own (a shard that hangs must not hold
  the event loop), and ends the jobs a lost shard took with it (tasks.hop.shard_watch).

The worker's heartbeat, and the tasks given back, are tasks.hop.recovery's (this step starts after it: the
service's clock, which the sweeps read, is synced by its first beat).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from celery import bootsteps

from contract.jobs import expiry
from contract.jobs.ending import JobEnding
from contract.redis.clock import now as service_now
from contract.redis.connection import connect
from contract.redis.keys import Keys
from contract.redis.shards import bulk_plane
from tasks.hop.celery_app import settings_of
from tasks.hop.shard_watch import ShardWatch

log = logging.getLogger(__name__)


class JobSweeps(bootsteps.StartStopStep):
    """The consumer bootstep: the overdue jobs' sweep and the shard watch. Celery makes it itself; it reads the
    settings of the consumer's app."""

    requires = {"tasks.hop.recovery:HopRecovery"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.settings = settings_of(parent.app)
        self.keys = Keys(self.settings.namespace)
        self.sweep_s = self.settings.celery.sweep_s
        self.entries: list[Any] = []
        self.store: JobEnding | None = None
        # Set: this start's thread (the shard watch) stops. A new one per start, so that a thread of the start
        # before, not yet awake, cannot miss it.
        self.stopping = threading.Event()

    def start(self, consumer: Any) -> None:
        client = connect(self.settings, socket_timeout=2.0)
        self.store = JobEnding(client, self.keys, self.settings.jobs.ttl_s)
        self.entries = [consumer.timer.call_repeatedly(self.sweep_s, self.sweep, priority=10)]
        self.stopping = threading.Event()
        if self.settings.bulk.redis_urls:
            threading.Thread(target=self.watch_shards, args=(self.stopping,), name="shard-watch", daemon=True).start()

    def watch_shards(self, stopping: threading.Event) -> None:
        settings, keys = self.settings, self.keys
        client = connect(settings, socket_timeout=2.0)
        bulk = bulk_plane(settings, client)
        watch = ShardWatch(
            client, bulk, keys, JobEnding(client, keys, settings.jobs.ttl_s, bulk=bulk), settings.bulk.grace_s
        )
        while not stopping.wait(self.sweep_s):
            try:
                watch.check()
            except redis.RedisError as exc:  # the control plane away: the consumer says so; look again later
                log.debug("shard watch: %s", exc)

    def stop(self, consumer: Any) -> None:
        self.stopping.set()
        for entry in self.entries:
            entry.cancel()
        self.entries = []

    def sweep(self) -> None:
        assert self.store is not None
        try:
            ended = expiry.sweep(self.store, service_now())
        except redis.RedisError:
            return
        if ended:
            log.info("%d jobs expired at their deadline", ended, extra={"expired": ended})
