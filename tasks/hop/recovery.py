"""The CPU hop's recovery: a Celery worker process says it lives, and gives back the tasks that a dead worker, a
failover or a death mid-delivery left in no live worker's hands.

Every CPU and callback worker's main process, on its own event loop:

- every third of `celery.heartbeat_ttl_s`, refreshes its heartbeat (a key with that TTL) and its entry in
  the registry of workers, and gives back the messages recorded as its own that none of its tasks holds
  (`restore_unheld`: an ack or a delivery that a failover to a replica lost);
- then looks for registered workers whose heartbeat has lapsed: their main process died (SIGKILL, OOM, a
  host gone) with tasks in hand, which kombu would give back only after `visibility_timeout_s` (300 s;
  it cannot be shorter than the longest task). Each message such a worker held (tasks.hop.broker keeps them
  in its own hash) goes back to the front of its queue at once; one worker at
  a time does this for a given dead worker (a lock with a TTL), and a restore that is cut short is done
  again by the next one (restoring a message twice puts it back once);
- every `celery.lost_delivery_s`, on a thread of its own, sends again the tasks that a worker killed as it took
  them from Redis lost (tasks.hop.lost_deliveries: neither the reaper nor kombu knows of them).

How a message goes back is tasks.hop.given_back's and tasks.hop.lost_deliveries'; this step is when, and whose. The
jobs' own sweeps (deadlines, lost shards) are tasks.hop.job_sweeps'.

A worker that was only paused past its heartbeat (SIGSTOP, a stalled host) finds its tasks taken over: a
child still running one cannot push its frame (the claim it holds was replaced: contract.frames.frame_push's
FramePusher.push).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from celery import bootsteps

from contract.redis.clock import CLOCK
from contract.redis.clock import now as service_now
from contract.redis.connection import connect
from contract.redis.keys import Keys
from tasks.hop.broker import holder_id
from tasks.hop.celery_app import settings_of
from tasks.hop.given_back import legacy_unacked_key, reap_dead_workers, restore_unheld, tags_in_hand
from tasks.hop.lost_deliveries import LostDeliveries

log = logging.getLogger(__name__)


class HopRecovery(bootsteps.StartStopStep):
    """The consumer bootstep: the worker's heartbeat, and the tasks of dead workers and lost deliveries given back.
    Celery makes it itself; it reads the settings of the consumer's app."""

    # After Tasks: the task consumer's channel (whose QoS restores messages) exists by then.
    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.settings = settings_of(parent.app)
        self.keys = Keys(self.settings.namespace)
        self.ttl_s = self.settings.celery.heartbeat_ttl_s
        self.entries: list[Any] = []
        self.client: redis.Redis | None = None
        self.tenants: list[str] = []  # the API keys whose own queues this worker takes
        # Set: this start's thread (the lost-delivery search) stops. A new one per start, so that a thread of the
        # start before, not yet awake, cannot miss it.
        self.stopping = threading.Event()

    def start(self, consumer: Any) -> None:
        self.client = connect(self.settings, socket_timeout=2.0)
        CLOCK.follow(self.client, sync=False)  # synced by the first beat, below
        self.tenants = sorted(
            {tenant for queue in consumer.app.amqp.queues.consume_from if (tenant := self.keys.tenant_of_queue(queue))}
        )
        channel = consumer.task_consumer.channel
        self.beat(channel)
        self.entries = [consumer.timer.call_repeatedly(self.ttl_s / 3.0, self.beat, (channel,), priority=10)]
        self.stopping = threading.Event()
        # Off the event loop (which delivers the tasks): a round reads every live job's status, and queues.
        unacked = legacy_unacked_key(channel)
        threading.Thread(
            target=self.find_lost, args=(unacked, self.stopping), name="lost-deliveries", daemon=True
        ).start()

    def find_lost(self, unacked_key: str, stopping: threading.Event) -> None:
        every_s = self.settings.celery.lost_delivery_s
        lost = LostDeliveries(connect(self.settings, socket_timeout=2.0), self.keys, unacked_key, every_s)
        while not stopping.wait(every_s):
            try:
                resent = lost.check(service_now())
            except redis.RedisError as exc:  # Redis away: the consumer says so; look again next time
                log.debug("lost deliveries: %s", exc)
                continue
            except Exception:  # a record it cannot read must not end the search for good
                log.exception("lost deliveries: a round failed")
                continue
            for job_id in resent:
                log.warning(
                    "job %s's task was in no queue and in no worker's hands (a worker died as it took it): sent again",
                    job_id,
                    extra={"job_id": job_id},
                )

    def stop(self, consumer: Any) -> None:
        self.stopping.set()
        for entry in self.entries:
            entry.cancel()
        self.entries = []
        if self.client is not None:  # a clean stop: kombu gives back what this worker holds itself
            try:
                self.client.delete(self.keys.cpu_heartbeat(holder_id()))
                self.client.zrem(self.keys.cpu_workers, holder_id())
            except redis.RedisError:
                pass

    def beat(self, channel: Any) -> None:
        assert self.client is not None
        keys, me = self.keys, holder_id()
        CLOCK.sync_if_due()
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(keys.cpu_heartbeat(me), str(service_now()), ex=max(1, round(self.ttl_s)))
            pipe.zadd(keys.cpu_workers, {me: service_now()})
            if self.tenants:
                pipe.hset(keys.cpu_tenants, mapping={tenant: str(service_now()) for tenant in self.tenants})
            pipe.execute()
            for holder, count in reap_dead_workers(
                self.client, keys, me, channel.qos.restore_held, channel.qos.restore_listed
            ).items():
                log.warning(
                    "worker %s was found dead: %d tasks it held are back on their queues",
                    holder,
                    count,
                    extra={"dead_worker": holder, "tasks": count},
                )
            restored = restore_unheld(self.client, keys, me, channel, tags_in_hand(), service_now())
            if restored:
                log.warning(
                    "%d tasks recorded as this worker's that it does not hold (a lost ack or delivery: "
                    "a failover) are back on their queues",
                    restored,
                    extra={"tasks": restored},
                )
        except redis.RedisError as exc:  # Redis away: the consumer reconnects on its own; beat again later
            log.warning("worker heartbeat: %s", exc)
