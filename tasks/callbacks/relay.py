"""The callback outbox's relay: ended jobs' callbacks, and retries that are due, handed to Celery."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from kombu.exceptions import OperationalError

from contract.library import Step
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from tasks.callbacks.slots import TenantSlots

log = logging.getLogger(__name__)


# The library's `take_from_outbox` (contract/library/callbacks.lua, where its keys and arguments are named).
_TAKE_FROM_OUTBOX = Step("take_from_outbox")
RELAY_STALE_AFTER_S = 60.0
# Redis (the job store, or the broker behind Celery) away: known, said once when it goes and once when it is back.
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OperationalError)


def relay_outbox(client: redis.Redis, keys: Keys, send: Callable[[str], None], limit: int = 100) -> int:
    """Hand ended jobs' callbacks, and retries that are due, to Celery. Each entry moves to `relaying` in the
    step that takes it and leaves it only once Celery has the task: a failed send puts it back at the outbox's
    head, and one whose relay died is taken again after RELAY_STALE_AFTER_S. Nothing is lost."""
    sent = 0
    while sent < limit:
        now = service_now()
        job_id = _TAKE_FROM_OUTBOX(
            client,
            [keys.callback_outbox, keys.callback_relaying, keys.callback_scheduled],
            [now, now - RELAY_STALE_AFTER_S],
        )
        if job_id is None:
            break
        try:
            send(job_id.decode())
        except Exception:
            pipe = client.pipeline(transaction=True)
            pipe.zrem(keys.callback_relaying, job_id)
            pipe.lpush(keys.callback_outbox, job_id)
            pipe.execute()
            raise
        client.zrem(keys.callback_relaying, job_id)
        sent += 1
    return sent


class OutboxRelay:
    """The callback worker's relay: a thread that wakes when a job with a callback ends (the outbox's
    channel; at least every second) and hands ended jobs' callbacks to Celery. One per callback worker;
    several may run at once."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        send: Callable[[str], None],
        slots: TenantSlots | None = None,
        retry_s: float = 1.0,
    ) -> None:
        """`slots`: the tenants' callback slots, whose held callbacks it moves on once a slot has lapsed.
        `retry_s`: how long it waits before trying again when Redis is away."""
        self.client, self.keys, self.send, self.slots = client, keys, send, slots
        self.retry_s = retry_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        away = False
        while not self._stopping.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.keys.callback_outbox)
                while not self._stopping.is_set():
                    pubsub.get_message(timeout=1.0)
                    if self.slots is not None:
                        self.slots.free_lapsed()
                    relay_outbox(self.client, self.keys, self.send)
                    if away:
                        log.info("callback relay: Redis is back, relaying again")
                        away = False
            except CONNECTION_ERRORS as error:  # nothing was lost: the outbox is relayed once Redis answers
                if not away:
                    log.warning("callback relay: Redis unreachable (%s); trying again every %g s", error, self.retry_s)
                else:
                    log.debug("callback relay: Redis still unreachable (%s)", error)
                away = True
                self._stopping.wait(self.retry_s)
            except Exception:  # not a known connection error: its traceback says what it was
                log.warning("callback relay interrupted", exc_info=True)
                self._stopping.wait(self.retry_s)
            finally:
                pubsub.close()
