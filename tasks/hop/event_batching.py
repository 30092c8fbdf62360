"""A worker's task events (what Flower shows) leave in one message per interval, not one per loop turn.

Celery buffers a worker's task events (received, started, succeeded) and, on
its own, publishes the buffer on the event loop's next turn: under load that
is one message for nearly every event, and each costs the worker a publish,
Redis a PUBLISH and Flower a pub/sub read, a decode and a thread hand-off
(docs/benchmarks/2026-12-02-stack-cpu-by-role.md). This step makes the buffer
wait `celery.events_flush_ms` after its first event instead, so a message
carries every event of that interval (Celery still publishes at once when 24
are waiting: EVENTS_A_MESSAGE raises that bound, below). Flower shows the same
tasks with the same times (each event is stamped when it happens); it hears of
them up to that interval later. 0 keeps Celery's own behaviour.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from tasks.hop.celery_app import settings_of

# Celery publishes a buffer at 24 events (8 tasks), which a busy worker fills many times an interval: each a round
# trip to the control plane. A bound ten times that keeps a message small for Flower to read (about a hundred KB)
# and leaves the interval, not the bound, to decide when a busy worker publishes.
EVENTS_A_MESSAGE = 240


class BatchTaskEvents(bootsteps.StartStopStep):
    """The consumer bootstep. Celery makes it itself; it reads the settings of the consumer's app."""

    # After Events: its start makes a new dispatcher each time the consumer (re)connects.
    requires = {"celery.worker.consumer.events:Events"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.delay_s = settings_of(parent.app).celery.events_flush_ms / 1000.0
        self.flush_entry: Any = None

    def start(self, consumer: Any) -> None:
        dispatcher = consumer.event_dispatcher
        if self.delay_s <= 0 or dispatcher is None or consumer.hub is None:
            return

        def flush() -> None:
            self.flush_entry = None
            consumer._flush_events()

        def on_buffered() -> None:
            if self.flush_entry is None:
                self.flush_entry = consumer.timer.call_after(self.delay_s, flush, priority=10)

        dispatcher.on_send_buffered = on_buffered
        dispatcher.buffer_limit = EVENTS_A_MESSAGE

    def stop(self, consumer: Any) -> None:
        """Whatever waits goes now (a worker stopping, or a consumer reconnecting)."""
        if self.flush_entry is not None:
            self.flush_entry.cancel()
            self.flush_entry = None
        if consumer.event_dispatcher is not None:
            consumer._flush_events()
