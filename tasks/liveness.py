"""A Celery worker process says it lives, gives back the tasks of workers found dead, and ends overdue jobs.

Every CPU and callback worker's main process, on its own event loop:

- every third of `celery.heartbeat_ttl_s`, refreshes its heartbeat (a key with that TTL) and its entry in
  the registry of workers, and gives back the messages recorded as its own that none of its tasks holds
  (`restore_unheld`: an ack or a delivery that a failover to a replica lost);
- then looks for registered workers whose heartbeat has lapsed: their main process died (SIGKILL, OOM, a
  host gone) with tasks in hand, which kombu would give back only after `visibility_timeout_s` (300 s;
  it cannot be shorter than the longest task). Each message such a worker held (tasks.broker keeps them
  in its own hash) goes back to the front of its queue at once; one worker at
  a time does this for a given dead worker (a lock with a TTL), and a restore that is cut short is done
  again by the next one (restoring a message twice puts it back once);
- every `celery.sweep_s`, ends `expired` the jobs whose deadline has passed (contract.expiry.sweep);
- every `celery.lost_delivery_s`, on a thread of its own, sends again the tasks that a worker killed as it took
  them from Redis lost (tasks.lost_deliveries: neither the reaper nor kombu knows of them);
- with bulk shards, looks at each shard as often, on a thread of its own (a shard that hangs must not hold
  the event loop), and ends the jobs a lost shard took with it (tasks.shard_watch).

A worker that was only paused past its heartbeat (SIGSTOP, a stalled host) finds its tasks taken over: a
child still running one cannot push its frame (the claim it holds was replaced: contract.frame_push's FramePusher.push).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from celery import bootsteps

from contract import expiry
from contract.clock import CLOCK
from contract.clock import now as service_now
from contract.connection import connect
from contract.jobs.ending import JobEnding
from contract.keys import Keys
from contract.settings import Settings
from contract.shards import bulk_plane
from tasks.broker import holder_id
from tasks.given_back import legacy_unacked_key, reap_dead_workers, restore_unheld, tags_in_hand
from tasks.lost_deliveries import LostDeliveries
from tasks.shard_watch import ShardWatch

log = logging.getLogger(__name__)


def keep_alive(settings: Settings) -> type[bootsteps.StartStopStep]:  # noqa: C901  # a class's methods, counted as one
    """The consumer bootstep for these settings (Celery instantiates steps itself, with no arguments of ours)."""
    keys = Keys(settings.namespace)
    ttl_s, sweep_s = settings.celery.heartbeat_ttl_s, settings.celery.sweep_s

    class WorkerLiveness(bootsteps.StartStopStep):
        # After Tasks: the task consumer's channel (whose QoS restores messages) exists by then.
        requires = {"celery.worker.consumer.tasks:Tasks"}

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.entries: list[Any] = []
            self.client: redis.Redis | None = None
            self.store: JobEnding | None = None
            self.tenants: list[str] = []  # the API keys whose own queues this worker takes
            # Set: this start's threads (the shard watch, the lost-delivery search) stop. A new one per start, so
            # that a thread of the start before, not yet awake, cannot miss it.
            self.stopping = threading.Event()

        def start(self, consumer: Any) -> None:
            self.client = connect(settings, socket_timeout=2.0)
            CLOCK.follow(self.client, sync=False)  # synced by the first beat, below
            self.store = JobEnding(self.client, keys, settings.jobs.ttl_s)
            self.tenants = sorted(
                {tenant for queue in consumer.app.amqp.queues.consume_from if (tenant := keys.tenant_of_queue(queue))}
            )
            channel = consumer.task_consumer.channel
            self.beat(channel)
            self.entries = [
                consumer.timer.call_repeatedly(ttl_s / 3.0, self.beat, (channel,), priority=10),
                consumer.timer.call_repeatedly(sweep_s, self.sweep, priority=10),
            ]
            self.stopping = threading.Event()
            # Off the event loop (which delivers the tasks): a round reads every live job's status, and queues.
            unacked = legacy_unacked_key(channel)
            threading.Thread(
                target=self.find_lost, args=(unacked, self.stopping), name="lost-deliveries", daemon=True
            ).start()
            if settings.bulk.redis_urls:
                threading.Thread(
                    target=self.watch_shards, args=(self.stopping,), name="shard-watch", daemon=True
                ).start()

        def watch_shards(self, stopping: threading.Event) -> None:
            client = connect(settings, socket_timeout=2.0)
            bulk = bulk_plane(settings, client)
            watch = ShardWatch(
                client, bulk, keys, JobEnding(client, keys, settings.jobs.ttl_s, bulk=bulk), settings.bulk.grace_s
            )
            while not stopping.wait(sweep_s):
                try:
                    watch.check()
                except redis.RedisError as exc:  # the control plane away: the consumer says so; look again later
                    log.debug("shard watch: %s", exc)

        def find_lost(self, unacked_key: str, stopping: threading.Event) -> None:
            lost = LostDeliveries(
                connect(settings, socket_timeout=2.0), keys, unacked_key, settings.celery.lost_delivery_s
            )
            while not stopping.wait(settings.celery.lost_delivery_s):
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
                        "job %s's task was in no queue and in no worker's hands (a worker died as it took it): "
                        "sent again",
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
                    self.client.delete(keys.cpu_heartbeat(holder_id()))
                    self.client.zrem(keys.cpu_workers, holder_id())
                except redis.RedisError:
                    pass

        def beat(self, channel: Any) -> None:
            assert self.client is not None
            me = holder_id()
            CLOCK.sync_if_due()
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.set(keys.cpu_heartbeat(me), str(service_now()), ex=max(1, round(ttl_s)))
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

        def sweep(self) -> None:
            assert self.store is not None
            try:
                ended = expiry.sweep(self.store, service_now())
            except redis.RedisError:
                return
            if ended:
                log.info("%d jobs expired at their deadline", ended, extra={"expired": ended})

    return WorkerLiveness
