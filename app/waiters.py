"""Long-poll support: one pub/sub listener per API process wakes every waiter, and the wait for one job's end.

Each process subscribes once to the job-events channel (the GPU and CPU
workers publish the ids of the jobs a step ended, space-separated: a batch's
ends are one message) and sets the events of the requests waiting on them. No
request polls Redis while it waits, and a thousand waiting requests cost one
Redis connection, not a thousand.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

import redis

from contract.jobs import expiry
from contract.jobs.deadlines import PAST_BY_S, seconds_left
from contract.jobs.ending import JobEnding
from contract.jobs.record import TERMINAL, JobRecord

log = logging.getLogger(__name__)


class JobEventListener:
    def __init__(self, client: redis.Redis, channel: str, on_tick=lambda: None) -> None:
        self.redis = client
        self.channel = channel
        self.on_tick = on_tick  # run after every event and at least every second
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = defaultdict(set)
        self._thread: threading.Thread | None = None
        self._subscribed = threading.Event()
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop listening (the thread ends within its poll interval)."""
        self._closed.set()
        self._wake_all()

    def start(self) -> None:
        self._ensure_running()

    def register(self, job_id: str) -> threading.Event:
        """Call before re-reading the job, so an ending between the read and the wait is not missed."""
        self._ensure_running()
        event = threading.Event()
        with self._lock:
            self._waiters[job_id].add(event)
        return event

    def unregister(self, job_id: str, event: threading.Event) -> None:
        with self._lock:
            waiters = self._waiters.get(job_id)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[job_id]

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # Started lazily: gunicorn forks after import, and threads do not survive a fork.
                self._thread = threading.Thread(target=self._listen_forever, name="job-events", daemon=True)
                self._thread.start()
        self._subscribed.wait(timeout=2.0)

    def _listen_forever(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            try:
                self._listen()
            except Exception as exc:  # RedisError, or the client library tripping over a dead socket
                if not self._closed.is_set():
                    log.warning("job-event listener lost Redis (%s); resubscribing", exc)
            self._subscribed.clear()
            self._wake_all()  # anything may have ended while we were deaf
            self._closed.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _listen(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.channel)
            self._subscribed.set()
            while not self._closed.is_set():
                message = pubsub.get_message(timeout=1.0)
                if message and message["type"] == "message":
                    self._wake(message["data"].decode().split())
                self.on_tick()
        finally:
            pubsub.close()

    def _wake(self, job_ids: list[str]) -> None:
        with self._lock:
            for job_id in job_ids:
                for event in self._waiters.get(job_id, ()):
                    event.set()

    def _wake_all(self) -> None:
        with self._lock:
            for events in self._waiters.values():
                for event in events:
                    event.set()


def until_ended(store: JobEnding, job_id: str, record: JobRecord, wait_s: float, event: threading.Event) -> JobRecord:
    """The job once it ended, or as it stands after `wait_s`. No point waiting past its deadline: it is over by
    then, one way or another (expire_if_late says so). A wake-up that finds it still live (the listener
    resubscribing wakes every waiter) waits on for the time left."""
    until = time.monotonic() + wait_s
    while record["status"] not in TERMINAL:
        left = min(until - time.monotonic(), seconds_left(record["deadline_at"]) + PAST_BY_S)
        if left <= 0:
            break
        woken = event.wait(left)
        event.clear()
        record = store.load(job_id) or record
        if not woken:
            break
    return record


def expire_if_late(store: JobEnding, record: JobRecord) -> JobRecord:
    """A live job past its deadline is over, even when no worker is left to say so (contract.jobs.expiry)."""
    # Late asked of the deadline alone: the id goes to the store only for a job to end (no detour through expiry).
    if record["status"] in TERMINAL or not expiry.is_late(record["deadline_at"]):
        return record
    expiry.expire(store, record["id"], expiry.BEFORE_AN_ANSWER)
    return store.load(record["id"]) or record
