"""What Flower sees: every task's events, from a real CPU worker, several to a message (tasks.hop.event_batching)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import redis
from kombu.asynchronous.timer import Timer

from bench.stack.processes import RedisServer
from contract.jobs.task_messages import PREPROCESS_TASK
from contract.settings.config import load_settings
from tasks.hop.celery_app import make_celery
from tasks.hop.event_batching import EVENTS_A_MESSAGE, BatchTaskEvents
from tests.support import jpeg, wait_until

pytestmark = pytest.mark.integration


def test_every_task_event_arrives_and_they_travel_together(stack) -> None:
    app = make_celery(stack.settings)
    kinds_by_task: dict[str, list[str]] = defaultdict(list)
    task_of_job: dict[str, str] = {}
    message_sizes: list[int] = []
    lock = threading.Lock()

    def on_event(event: dict[str, Any]) -> None:
        with lock:
            kinds_by_task[event["uuid"]].append(event["type"])
            if event["type"] == "task-received" and event.get("name") == PREPROCESS_TASK:
                task_of_job[str(event.get("args", ""))] = event["uuid"]

    def task_for(job_id: str) -> str | None:
        with lock:
            return next((task for args, task in task_of_job.items() if job_id in args), None)

    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(
            connection, handlers={"task-received": on_event, "task-started": on_event, "task-succeeded": on_event}
        )
        deliver = receiver._receive

        def count_and_deliver(body: Any, message: Any) -> None:
            batch = body if isinstance(body, list) else [body]
            with lock:
                message_sizes.append(sum(1 for event in batch if str(event.get("type", "")).startswith("task-")))
            deliver(body, message)

        receiver._receive = count_and_deliver  # type: ignore[method-assign]
        listening = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None}, daemon=True)
        listening.start()
        try:
            # Listening starts with the receiver's first poll: until a job's events are heard, try another.
            def heard_one() -> bool:
                job_id = stack.submit_ok(jpeg(64, 48))
                stack.wait_terminal(job_id)
                try:
                    wait_until(lambda: task_for(job_id) is not None, 3)
                except AssertionError:
                    return False
                return True

            wait_until(heard_one, 60, what="the events of a first job")
            with lock:
                message_sizes.clear()
            job_ids = [stack.submit_ok(jpeg(320, 240, seed=i)) for i in range(6)]
            for job_id in job_ids:
                assert stack.wait_terminal(job_id)["status"] == "succeeded"

            def succeeded_heard(job_id: str) -> bool:
                task = task_for(job_id)
                with lock:
                    return task is not None and "task-succeeded" in kinds_by_task[task]

            wait_until(
                lambda: all(succeeded_heard(job_id) for job_id in job_ids), 30, what="every job's task-succeeded event"
            )
        finally:
            receiver.should_stop = True
            listening.join(timeout=10)

    with lock:
        for job_id in job_ids:
            kinds = kinds_by_task[task_of_job[next(args for args in task_of_job if job_id in args)]]
            assert {"task-received", "task-started", "task-succeeded"} <= set(kinds), kinds
        # Celery alone sends about one message per event at this pace; batched, several travel together.
        assert len(message_sizes) * 3 <= sum(message_sizes), message_sizes


class Batching(NamedTuple):
    """Celery's own event dispatcher on a Redis of the test's, the batching step started on a consumer of it."""

    dispatcher: Any
    consumer: SimpleNamespace
    step: BatchTaskEvents
    flushed: list[int]
    client: redis.Redis

    def publishes(self) -> int:
        return int(self.client.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))


@pytest.fixture
def batching(tmp_path) -> Iterator[Batching]:
    server = RedisServer(tmp_path)
    client = redis.Redis(port=server.port)
    settings = dataclasses.replace(load_settings(), redis_url=server.url, namespace="events")
    app = make_celery(settings)
    try:
        with app.connection_for_write() as connection:
            dispatcher = app.events.Dispatcher(connection, hostname="w@test", buffer_group=["task"])
            flushed: list[int] = []
            consumer = SimpleNamespace(
                event_dispatcher=dispatcher,
                hub=object(),
                timer=Timer(),
                _flush_events=lambda: (flushed.append(1), dispatcher.flush()),
            )
            step = BatchTaskEvents(SimpleNamespace(app=app))
            step.start(consumer)
            yield Batching(dispatcher, consumer, step, flushed, client)
            consumer.timer.stop()
            dispatcher.close()
    finally:
        client.close()
        server.stop()


def test_a_busy_workers_events_wait_for_the_interval_not_for_celerys_24(batching: Batching) -> None:
    """The batching step raises Celery's buffer bound: thirty tasks' events (ninety) wait for the interval's flush and
    leave in one PUBLISH, where Celery alone publishes at every 24th; past the new bound one leaves at once."""
    dispatcher, consumer, step = batching.dispatcher, batching.consumer, batching.step
    for n in range(30):
        for kind in ("task-received", "task-started", "task-succeeded"):
            dispatcher.send(kind, uuid=f"task-{n}")
    assert batching.publishes() == 0  # 90 events buffered: Celery alone would have published three times
    step.stop(consumer)  # what the interval's timer does, at a stop
    assert batching.flushed and batching.publishes() == 1
    for n in range(EVENTS_A_MESSAGE):
        dispatcher.send("task-received", uuid=f"more-{n}")
    assert batching.publishes() == 2  # the bound reached: at once, not at the interval


def test_events_past_the_bound_leave_with_the_interval_of_the_first(batching: Batching) -> None:
    """A burst past the bound: the bound's flush sends the first 240 at once without asking for a timer (Celery calls
    on_send_buffered only when it does not flush), so what followed rides on the timer the burst's first event set:
    a worker idle after the burst still sends it, one interval after the burst began."""
    dispatcher, consumer, step = batching.dispatcher, batching.consumer, batching.step
    for n in range(EVENTS_A_MESSAGE + 60):
        dispatcher.send("task-received", uuid=f"task-{n}")
    assert batching.publishes() == 1 and len(dispatcher._group_buffer["task"]) == 60
    deadline = time.monotonic() + 5 * step.delay_s + 5
    while dispatcher._group_buffer["task"]:  # the worker's loop: run the timer's entries as they fall due
        assert time.monotonic() < deadline, "the burst's rest never left"
        wait, entry = next(iter(consumer.timer))
        if entry is not None:
            entry()
        else:
            time.sleep(min(wait or 0.01, 0.01))
    assert batching.publishes() == 2 and step.flush_entry is None
