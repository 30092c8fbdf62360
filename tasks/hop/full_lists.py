"""A CPU worker stops taking a model's jobs while that model's frame list is full, but a light API key's.

Else every child would end up waiting for room on a saturated model while other models' jobs queue
behind it. The main process checks each model's list on its own event loop, pauses that model's queues
while the list lacks room for the tasks this worker may hold, and resumes them when it has. Why, and
what was measured: docs/architecture.md ("A CPU worker stops taking a model whose frame list is full").
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery import bootsteps

from contract.redis.connection import connect
from contract.redis.keys import PREPROCESS_QUEUE, Keys
from tasks.hop.celery_app import settings_of

log = logging.getLogger(__name__)

CLOSE_CHECK_S = 0.01  # short enough that a quiet model's jobs do not wait behind a full one (docs/architecture.md)
IDLE_CHECK_S = 0.1
# A busy model's list empties by a whole batch at a time and refills within milliseconds: judged by one
# look, it would seem calm half the time (and slow checks let the children fill it and wait on it again).
CALM_AFTER_S = 1.0


def full_models(depths: list[int], limits: list[int], held: int, paused: set[int]) -> tuple[set[int], set[int]]:
    """Which models (by index) to pause and which to resume: those whose list has no room left for the
    `held` tasks this worker may already have of it, from their list depths and bounds."""
    full = {i for i, (depth, limit) in enumerate(zip(depths, limits)) if depth >= max(1, limit - held)}
    return full - paused, paused - full


def queues_to_hold(full: set[int], queues: list[list[str]], counts: list[dict[str, int]], head: int) -> set[str]:
    """The CPU queues to pause: every queue of a full model but a light key's. A key with fewer than `head` frames
    of the model waiting or in flight (`counts`, Keys.key_frames) has its frame pushed to the list's head past the
    bound (contract.frames.frame_push): its job need not wait for room, and waits behind a flood's if held."""
    held = set()
    for index in full:
        for queue in queues[index]:
            tenant = Keys.tenant_of_queue(queue)
            if not tenant or head <= 0 or counts[index].get(tenant, 0) >= head:
                held.add(queue)
    return held


class PauseWhileFrameListFull(bootsteps.StartStopStep):
    """The consumer bootstep. Celery makes it itself; it reads the settings of the consumer's app."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        settings = self.settings = settings_of(parent.app)
        keys = self.keys = Keys(settings.namespace)
        self.frames = [keys.frames(spec.key) for spec in settings.models]
        self.queues = [keys.preprocess_queues(spec.key, settings.tenants) for spec in settings.models]
        self.limits = [settings.max_frames(spec) for spec in settings.models]
        self.paused: set[str] = set()  # queues
        self.head = settings.backpressure.head_frames_per_key
        self.key_frames = [keys.key_frames(spec.key) for spec in settings.models]
        self.held = 1
        self.busy_until = 0.0
        self.timer_entry: Any = None
        self.client: redis.Redis | None = None
        self.sharded = bool(settings.bulk.redis_urls)
        # The depths the consumer's last take brought (ride, took) and when it was sent: a check this fresh reads
        # no Redis of its own. A busy worker takes more often than it checks, so its checks cost no round trip.
        self.taken_depths: list[int] | None = None
        self.taken_at = 0.0
        self._sending_at = 0.0

    def start(self, consumer: Any) -> None:
        if PREPROCESS_QUEUE not in consumer.app.amqp.queues.consume_from:
            return  # the callback worker
        self.client = connect(self.settings, socket_timeout=1.0)
        self.held = max(1, int(getattr(consumer, "initial_prefetch_count", 0) or 1))
        self._schedule(consumer, IDLE_CHECK_S)

    def ride(self) -> list[tuple[Any, ...]]:
        """The depths' read, in the consumer's take (tasks.hop.broker.TakeRider): only while the checks come close
        (a list half full lately), and not again while the last take's is still fresh for the next check."""
        now = time.monotonic()
        if now >= self.busy_until or now - self.taken_at < CLOSE_CHECK_S / 2:
            return []
        self._sending_at = now
        if self.sharded:
            return [("HMGET", self.keys.frames_waiting, *[spec.key for spec in self.settings.models])]
        return [("LLEN", key) for key in self.frames]

    def took(self, replies: list[Any]) -> None:
        if any(isinstance(reply, Exception) for reply in replies):
            return  # read on the check's own, as before
        counts = replies[0] if self.sharded and replies else replies
        try:
            depths = [int(count or 0) for count in counts]
        except (TypeError, ValueError):
            return  # a reading that is no count: the check reads for itself, as before the ride
        if len(depths) == len(self.frames):
            self.taken_depths, self.taken_at = depths, self._sending_at

    def _ride_the_takes(self, consumer: Any) -> None:
        # The channel the consumer polls is made again on a reconnect: the rider is put on whichever it is now.
        channel = getattr(getattr(consumer, "task_consumer", None), "channel", None)
        if channel is not None and getattr(channel, "rider", self) is not self:
            channel.rider = self

    def _schedule(self, consumer: Any, delay_s: float) -> None:
        self.timer_entry = consumer.timer.call_after(delay_s, self.check, (consumer,), priority=10)

    def stop(self, consumer: Any) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None

    def check(self, consumer: Any) -> None:
        self._ride_the_takes(consumer)
        try:
            depths = self._depths()
        except redis.RedisError:  # the consumer has its own reconnection; look again later
            self._schedule(consumer, IDLE_CHECK_S)
            return
        now = time.monotonic()
        if self.paused or any(2 * depth >= limit for depth, limit in zip(depths, self.limits)):
            self.busy_until = now + CALM_AFTER_S
        self._schedule(consumer, CLOSE_CHECK_S if now < self.busy_until else IDLE_CHECK_S)
        self._apply(consumer, depths)

    def _depths(self) -> list[int]:
        if self.taken_depths is not None and time.monotonic() - self.taken_at < CLOSE_CHECK_S:
            return self.taken_depths
        assert self.client is not None
        if self.sharded:  # the lists lie on the shards: their count, kept on the control plane
            counts = self.client.hmget(self.keys.frames_waiting, [spec.key for spec in self.settings.models])
            return [int(count or 0) for count in counts]
        pipe = self.client.pipeline(transaction=False)
        for key in self.frames:
            pipe.llen(key)
        return [int(depth) for depth in pipe.execute()]

    def _counts(self, full: set[int]) -> list[dict[str, int]]:
        """Each full model's keys' frames waiting or in flight (read only while a list is full)."""
        counts: list[dict[str, int]] = [{} for _ in self.queues]
        if not full or self.head <= 0:
            return counts
        assert self.client is not None
        pipe = self.client.pipeline(transaction=False)
        for index in sorted(full):
            pipe.hgetall(self.key_frames[index])
        for index, held in zip(sorted(full), pipe.execute()):
            counts[index] = {name.decode(): int(count) for name, count in held.items()}
        return counts

    def _apply(self, consumer: Any, depths: list[int]) -> None:
        full, _ = full_models(depths, self.limits, self.held, set())
        hold = queues_to_hold(full, self.queues, self._counts(full), self.head)
        tasks = consumer.task_consumer
        for queue in hold - self.paused:
            tasks.cancel_by_queue(queue)
            log.debug("paused %s: its frame list is full", queue)
        resume = self.paused - hold
        for queue in resume:
            tasks.add_queue(consumer.app.amqp.queues[queue])
            log.debug("resumed %s", queue)
        self.paused = hold
        if resume:
            tasks.consume()
