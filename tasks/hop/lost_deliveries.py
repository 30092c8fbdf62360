"""Jobs whose preprocess task was lost on its way to a worker are sent their task again.

Kombu's Redis transport takes a message off its queue with BRPOP, and records it as unacknowledged (and as this
worker's: tasks.hop.broker) only once the reply has reached the worker. A worker killed between the two (SIGKILL, OOM,
a host gone) takes the message with it: Redis popped it, nothing holds it, and kombu's visibility timeout never
sees it. Its job stays `queued` until its deadline ends it `expired`. That window is a few milliseconds; a CPU
worker killed under load meets it (the compose stack's kill test did).

So, every `celery.lost_delivery_s`, one worker (a lock) looks at the live jobs (the deadline index) still
`queued` after that long: a job whose task is in no queue and in no worker's hands (a registered worker's held list
or hash, or kombu's unacked hash where a 0.1.0 worker left it), seen so
twice in a row (a message is between the two for milliseconds while it moves), is sent its task again, at the
front of its queue. A task delivered twice is harmless: the claim lets one attempt push a frame
(contract.jobs.handoff), and a job past `queued` drops a late task.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import cast

import redis

from contract.jobs.deadlines import live_scores
from contract.jobs.record import QUEUED
from contract.jobs.task_messages import PreprocessMessages
from contract.library import Step
from contract.redis.keys import Keys

log = logging.getLogger(__name__)

# A preprocess message names its job in its `argsrepr` header (['<id>']), in plain JSON (a queue, a held list) or as
# a worker's hash (or kombu's unacked hash) keeps it (the message's JSON inside a JSON list); the body itself is base64.
_JOB_IN_MESSAGE = re.compile(rb"\['([0-9a-f]{32})'\]")

# A job sent its task again, once per round at most: the library's `resend_task` (contract/library/cpu_hop.lua).
_RESEND = Step("resend_task")

MAX_JOBS = 5000  # live jobs looked at per round: the deadline index's soonest
MAX_RESENDS = 3  # per job


def jobs_named(messages: Iterable[bytes]) -> set[str]:
    """The job ids that preprocess messages (raw, or as a worker's holds keep them) carry."""
    return {match.decode() for message in messages for match in _JOB_IN_MESSAGE.findall(message)}


class LostDeliveries:
    """One round of the search (`check`), and what it must remember between rounds: the suspects, in Redis (the
    next round may be another worker's)."""

    def __init__(self, client: redis.Redis, keys: Keys, unacked_key: str, after_s: float) -> None:
        self.redis = client
        self.keys = keys
        self.unacked_key = unacked_key
        self.after_s = after_s
        self.messages = PreprocessMessages()

    def check(self, now: float) -> list[str]:
        """One round, if no other worker has one under way: the jobs sent their task again."""
        # Rounds at least 0.8 of the period apart, whoever runs them (each worker's timer is on its own clock).
        if not self.redis.set(self.keys.lost_deliveries_lock, "1", nx=True, px=max(1, int(self.after_s * 800))):
            return []
        stale = self._stale_queued(now)
        missing = self._missing(stale)
        suspects_key = self.keys.lost_deliveries_suspects
        before = {job_id.decode() for job_id in cast(list[bytes], self.redis.zrange(suspects_key, 0, -1))}
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(suspects_key)
        if missing:
            pipe.zadd(suspects_key, {job_id: now for job_id in missing})
            pipe.expire(suspects_key, max(1, round(self.after_s * 4)))
        pipe.execute()
        resent = []
        for job_id in sorted(missing & before):
            queue, count = stale[job_id]
            message = self.messages.build(job_id, queue)
            keys = [self.keys.job(job_id), self.keys.celery_queue(queue)]
            if _RESEND(self.redis, keys, [message, MAX_RESENDS, count]):
                resent.append(job_id)
        return resent

    def _stale_queued(self, now: float) -> dict[str, tuple[str, int]]:
        """{job id: (its queue, how many times it was sent its task again)} of the live jobs still `queued`
        `after_s` after they were submitted."""
        lowest, highest = live_scores(now)
        live = cast(list[bytes], self.redis.zrangebyscore(self.keys.deadlines, lowest, highest, 0, MAX_JOBS))
        if not live:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in live:
            pipe.hmget(self.keys.job(job_id.decode()), "status", "submitted_at", "queue", "resent")
        stale = {}
        for job_id, (status, submitted_at, queue, resent) in zip(live, pipe.execute()):
            # A job from before the record named its queue has no `queue`: left to its deadline, as before.
            if status == QUEUED.value.encode() and submitted_at and queue and float(submitted_at) < now - self.after_s:
                stale[job_id.decode()] = (queue.decode(), int(resent or 0))
        return stale

    def _missing(self, stale: dict[str, tuple[str, int]]) -> set[str]:
        """Those of `stale` whose task is neither on its queue nor held by a worker. Hands first, then queues: a
        message moves from a queue to hands, so one taken between the two reads is seen in neither only if its
        move took that long; the second sighting the next round asks for covers it."""
        if not stale:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hvals(self.unacked_key)
        for holder in cast(list[bytes], self.redis.zrange(self.keys.cpu_workers, 0, -1)):
            pipe.hvals(self.keys.celery_holds(holder.decode()))
            pipe.lrange(self.keys.celery_held(holder.decode()), 0, -1)  # what its takes moved (tasks.hop.broker)
        held = jobs_named(message for messages in pipe.execute() for message in messages)
        queued: set[str] = set()
        for queue in {queue for queue, _ in stale.values()}:
            queued |= jobs_named(cast(list[bytes], self.redis.lrange(self.keys.celery_queue(queue), 0, -1)))
        return set(stale) - held - queued
