"""The frame lists over bulk shards (contract.shards): contract.frames' moves, a list per shard.

A job's frame lies on its upload's shard. In: `ShardedFramePusher.push`, the frame onto the shard within the
shard's share of the bound, then the control plane's verdict on the job (the same checks as a push in one Redis:
contract.frames' PUSH_LUA); a frame that may not stand is taken back. Out: `ShardedFrameSource`, a processing list
per shard; `requeue_sharded_frames_of` gives a dead worker's frames back on every shard that answers.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from contract.clock import now as service_now
from contract.frames import (
    FRAME_JOB_ID_LUA,
    JOB_OVER,
    LIST_FULL,
    PUSH_LUA,
    PUSHED,
    FramePusher,
    RedisFrameSource,
    read_job_id,
)
from contract.jobs.record import PREPROCESSING, QUEUED_GPU, RUNNING, flatten_fields
from contract.keys import Keys
from contract.shards import SHARD_ERRORS, BulkPlane, ShardUnavailable

log = logging.getLogger(__name__)

# The frame goes to the job's shard first, kept only within the shard's bound: the push and this step in one
# MULTI, on the shard. KEYS[1] the frame list; ARGV[1] its bound. Returns 1 kept, 0 dropped again (the list was
# full).
_KEEP_WITHIN_BOUND = """
if redis.call('LLEN', KEYS[1]) > tonumber(ARGV[1]) then
  redis.call('LTRIM', KEYS[1], 1, -1)
  return 0
end
return 1
"""

# ...then this step, on the control plane, says whether the frame may stand: as contract.frames'
# _KEEP_PUSHED_FRAME's checks, and a job already `running` with this claim is the frame's own (a GPU worker took
# it before this step ran: the stamps are written, the status and the frame's bytes are left alone, its batch
# write gives them back). The frame is counted among its model's frames on the shards (Keys.frames_waiting; the
# batch write that acknowledges it counts it out, and each GPU worker's heartbeat sets the count to what the
# lists hold). KEYS[1] job hash, KEYS[2] the upload's marker, KEYS[3] waiting bytes, KEYS[4] frames waiting;
# ARGV[1] the claim, ARGV[2] the frame's length, ARGV[3..] field, value, ... Returns PUSHED or JOB_OVER (the
# caller takes the frame back).
_MARK_PUSHED = (
    PUSH_LUA
    + f"""
local status, model, upload_bytes = live_job(KEYS[1], KEYS[2], KEYS[3])
if not status then return {JOB_OVER} end
local claim = redis.call('HGET', KEYS[1], 'claim')
if (claim and claim ~= ARGV[1]) or (status ~= '{PREPROCESSING}' and status ~= '{RUNNING}') then return {JOB_OVER} end
if status == '{PREPROCESSING}' then
  if redis.call('EXISTS', KEYS[2]) == 0 then return {JOB_OVER} end
  redis.call('HSET', KEYS[1], 'status', '{QUEUED_GPU}')
  if model then redis.call('HINCRBY', KEYS[4], model, 1) end
  charge_frame(KEYS[3], model, tonumber(ARGV[2]))
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
release_upload(KEYS[2], KEYS[3], model, upload_bytes)
return {PUSHED}
"""
)


class ShardedFramePusher(FramePusher):
    """The CPU workers' end of the frame lists over bulk shards."""

    def __init__(self, client: redis.Redis, keys: Keys, bulk: BulkPlane) -> None:
        super().__init__(client, keys)
        self.bulk = bulk
        self._mark_pushed = client.register_script(_MARK_PUSHED)

    def push(
        self, job_id: str, model_key: str, frame: bytes, max_frames: int, fields: Mapping[str, Any], claim: str = ""
    ) -> int:
        """FramePusher.push with bulk shards: the frame onto the job's shard within the shard's bound, then the
        control plane's verdict (_MARK_PUSHED); a frame that may not stand is taken back. A worker that dies
        between the two leaves a frame whose job is still `preprocessing`: the task's redelivery pushes
        another, and the first one answered wins (contract.shards' note). ShardUnavailable when the shard does
        not answer."""
        index = self.bulk.index(job_id)
        shard, frames = self.bulk.clients[index], self.keys.frames(model_key)
        try:
            pipe = shard.pipeline(transaction=True)
            pipe.lpush(frames, frame)
            # EVAL, not EVALSHA: a script the shard has forgotten would fail inside the transaction after the push.
            pipe.eval(_KEEP_WITHIN_BOUND, 1, frames, self.bulk.frame_bound(max_frames))
            kept = int(pipe.execute()[1])
        except SHARD_ERRORS as exc:
            self.bulk.mark_down(index)
            raise ShardUnavailable(index, exc) from exc
        if not kept:
            return LIST_FULL
        stamps = flatten_fields({"updated_at": service_now(), **fields})
        outcome = int(
            self._mark_pushed(
                keys=[
                    self.keys.job(job_id),
                    self.keys.upload(job_id),
                    self.keys.waiting_bytes,
                    self.keys.frames_waiting,
                ],
                args=[claim, len(frame), *stamps],
            )
        )
        if outcome != PUSHED:
            try:
                shard.lrem(frames, 1, frame)  # type: ignore[arg-type]  # redis-py's stubs say str; bytes go
            except redis.RedisError:
                pass  # a GPU worker that takes it finds its job over (or another frame's) and skips it
        return outcome

    def has_room(self, model_key: str, max_frames: int, job_id: str = "") -> bool:
        """The job's shard's list, against its share of the bound."""
        if not job_id:
            return super().has_room(model_key, max_frames)
        return int(self.bulk.client_for(job_id).llen(self.keys.frames(model_key))) < self.bulk.frame_bound(max_frames)


def frame_pusher(client: redis.Redis, keys: Keys, bulk: BulkPlane | None = None) -> FramePusher:
    """The CPU workers' end of the frame lists: over `bulk`'s shards when it has any, else in `client`'s Redis."""
    return ShardedFramePusher(client, keys, bulk) if bulk is not None and bulk.sharded else FramePusher(client, keys)


# With bulk shards: a dead worker's frames go back per shard (contract.shards). On each shard this step moves
# the worker's processing lists back to their frame lists, oldest first in line, and returns the job ids it
# read from the moved frames' headers (their attempts are counted on the control plane). KEYS per model its
# processing list and its frame list.
_REQUEUE_ON_SHARD = (
    FRAME_JOB_ID_LUA
    + """
local moved = {}
for k = 1, #KEYS, 2 do
  while true do
    local frame = redis.call('LMOVE', KEYS[k], KEYS[k + 1], 'LEFT', 'RIGHT')
    if not frame then break end
    moved[#moved + 1] = frame_job_id(frame) or ''
  end
end
return moved
"""
)

# On the control plane, before: KEYS[1] the worker's heartbeat ('' when it gives back its own), KEYS[2] its
# epoch. -1 if it lives; else 1, its epoch deleted (a paused worker finds it gone and writes nothing more).
_FENCE = """
if KEYS[1] ~= '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
  redis.call('DEL', KEYS[2])
end
return 1
"""

# ...and after: an attempt more on each job (KEYS) that still exists.
_COUNT_ATTEMPTS = """
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then redis.call('HINCRBY', key, 'attempts', 1) end
end
return #KEYS
"""


def requeue_sharded_frames_of(
    client: redis.Redis,
    bulk: BulkPlane,
    keys: Keys,
    worker_id: str,
    model_keys: Sequence[str],
    only_if_dead: bool,
    count_attempt: bool = True,
) -> int:
    """requeue_frames_of over bulk shards: fenced on the control plane, moved on each shard, attempts counted.
    A shard that does not answer keeps its part: the worker stays in the registry (when reaping), so the next
    reaper tries again."""
    heartbeat = keys.heartbeat(worker_id) if only_if_dead else ""
    if int(client.register_script(_FENCE)(keys=[heartbeat, keys.gpu_epoch(worker_id)])) == -1:
        return -1
    lists = [key for model_key in model_keys for key in (keys.processing(worker_id, model_key), keys.frames(model_key))]
    moved: list[str] = []
    complete = True
    for index, shard in enumerate(bulk.clients):
        try:
            moved += [raw.decode() for raw in shard.register_script(_REQUEUE_ON_SHARD)(keys=lists)]
        except SHARD_ERRORS as exc:
            bulk.mark_down(index)
            complete = False
            log.warning("could not give back %s's frames on bulk shard %d: %s", worker_id, index, exc)
    counted = [keys.job(job_id) for job_id in moved if job_id]
    if count_attempt and counted:
        client.register_script(_COUNT_ATTEMPTS)(keys=counted)
    if only_if_dead and complete:
        client.zrem(keys.gpu_workers, worker_id)
    return len(moved)


class ShardedFrameSource:
    """One model's frame lists over the bulk shards, and this worker's processing list on each.

    Frames are taken from the shards that answer, one shard a look, in turn, and handed out in the order they
    were taken on each shard, so each shard's processing list keeps the module's order and `ack`
    still drops a batch's frames by count, per shard. While every list is empty, a thread per shard blocks on
    it (BLMOVE); a frame one of them brings after the wait ended is handed out first next time. A shard that
    fails is skipped for `bulk.retry_s`; before it is used again, once none of its frames is in hand, what is
    left in its processing list goes back (the worker may not know all it took there)."""

    acked_by_batch_write = False  # `ack` trims the shards' lists after the batch write (Finisher)

    def __init__(self, bulk: BulkPlane, keys: Keys, worker_id: str, model_key: str) -> None:
        self.bulk = bulk
        self.keys = keys
        self.worker_id = worker_id
        self.model_key = model_key
        self.shards = [RedisFrameSource(shard, keys, worker_id, model_key) for shard in bulk.clients]
        self.lock = threading.Condition()
        self.in_hand: deque[tuple[int, str]] = deque()  # (shard, job id) per frame handed out, oldest first
        self.early: list[deque[memoryview]] = [deque() for _ in self.shards]  # a waiter's, not yet handed out
        self.waiting = [False] * len(self.shards)  # a waiter is blocked on the shard
        # Its processing list is given back before the shard is used: at start (a shard that was down when the
        # worker gave back its previous life's frames still holds them), and after a call there failed.
        self.unsure = [True] * len(self.shards)
        self.turn = 0

    # --- taking -----------------------------------------------------------
    def pop_available(self, limit: int) -> list[memoryview]:
        taken: list[memoryview] = []
        with self.lock:
            for waited in self._rotation():
                while self.early[waited] and len(taken) < limit:
                    taken.append(self._hand_out(waited, self.early[waited].popleft()))
        # One shard a look, the next in turn: every look at a shard costs it a round trip whether it finds
        # frames or not, and a batch's window (12 ms) spans several looks (2 ms apart). Looking at every shard
        # each time kept each shard's CPU per image at half one shard's with three, not a third.
        index = next((shard for shard in self._rotation() if self._usable(shard)), None)
        self.turn = (self.turn + 1) % len(self.shards)
        if index is None or len(taken) >= limit:
            return taken
        try:
            frames = self.shards[index].pop_available(limit - len(taken))
        except SHARD_ERRORS as exc:
            self._failed(index, exc)
            return taken
        with self.lock:
            taken += [self._hand_out(index, frame) for frame in frames]
        return taken

    def pop_blocking(self, timeout_s: float) -> memoryview | None:
        with self.lock:
            for index in self._rotation():
                if not self.waiting[index] and self._usable(index):
                    self.waiting[index] = True
                    threading.Thread(
                        target=self._wait_on,
                        args=(index, timeout_s),
                        daemon=True,
                        name=f"frames-{self.model_key}-{index}",
                    ).start()
            self.lock.wait_for(lambda: any(self.early), timeout_s)
            for index in self._rotation():
                if self.early[index]:
                    return self._hand_out(index, self.early[index].popleft())
        return None

    def _wait_on(self, index: int, timeout_s: float) -> None:
        frame = None
        try:
            frame = self.shards[index].pop_blocking(timeout_s)
        except SHARD_ERRORS as exc:
            self._failed(index, exc)
        finally:
            with self.lock:
                self.waiting[index] = False
                if frame is not None:
                    self.early[index].append(frame)
                self.lock.notify_all()

    def _rotation(self) -> list[int]:
        count = len(self.shards)
        return [(self.turn + step) % count for step in range(count)]

    def _hand_out(self, index: int, frame: memoryview) -> memoryview:
        self.in_hand.append((index, read_job_id(frame) or ""))
        return frame

    def _usable(self, index: int) -> bool:
        """Up, no waiter blocked on it (its frames come through the waiter: the order), and resynced."""
        if self.waiting[index] or not self.bulk.is_up(index):
            return False
        if self.unsure[index]:
            with self.lock:
                if any(shard == index for shard, _ in self.in_hand) or self.early[index]:
                    return False
            try:
                requeue_own_on_shard(self.bulk.clients[index], self.keys, self.worker_id, [self.model_key])
            except SHARD_ERRORS as exc:
                self._failed(index, exc)
                return False
            self.unsure[index] = False
        return True

    def _failed(self, index: int, exc: BaseException) -> None:
        if self.bulk.is_up(index):
            log.warning("bulk shard %d failed (%s): skipped for %g s", index, exc, self.bulk.retry_s)
        self.bulk.mark_down(index)
        self.unsure[index] = True

    # --- answering ----------------------------------------------------------
    def _oldest(self, count: int) -> list[tuple[int, str]]:
        with self.lock:
            return [self.in_hand.popleft() for _ in range(min(count, len(self.in_hand)))]

    def ack(self, count: int, client: Any = None) -> None:
        """Drop the `count` oldest frames in hand from their shards' processing lists, and their uploads (kept
        until then: a CPU worker that died after its push leaves its job's task to be delivered again)."""
        by_shard: dict[int, list[str]] = {}
        for index, job_id in self._oldest(count):
            by_shard.setdefault(index, []).append(job_id)
        for index, job_ids in by_shard.items():
            pipe = self.bulk.clients[index].pipeline(transaction=False)
            pipe.ltrim(self.shards[index].processing_key, 0, -(len(job_ids) + 1))
            uploads = [self.keys.upload(job_id) for job_id in job_ids if job_id]
            if uploads:
                pipe.delete(*uploads)
            try:
                pipe.execute()
            except SHARD_ERRORS as exc:  # answered all the same; the list is given back before its next use
                self._failed(index, exc)

    def give_back(self, frames: Sequence[memoryview]) -> None:
        """The oldest frames in hand (these, in order) back to the front of their shards' lists."""
        by_shard: dict[int, list[memoryview]] = {}
        for (index, _), frame in zip(self._oldest(len(frames)), frames):
            by_shard.setdefault(index, []).append(frame)
        for index, taken in by_shard.items():
            pipe = self.bulk.clients[index].pipeline(transaction=True)
            pipe.rpush(self.shards[index].frames_key, *reversed(taken))
            pipe.ltrim(self.shards[index].processing_key, 0, -(len(taken) + 1))
            try:
                pipe.execute()
            except SHARD_ERRORS as exc:
                self._failed(index, exc)

    def forget(self) -> None:
        """After this worker gave back every shard's processing list: nothing is in hand."""
        with self.lock:
            self.in_hand.clear()
            for early in self.early:
                early.clear()


def requeue_own_on_shard(shard: redis.Redis, keys: Keys, worker_id: str, model_keys: Sequence[str]) -> int:
    """This worker's processing lists on one shard back to their frame lists (no attempt counted)."""
    lists = [key for model_key in model_keys for key in (keys.processing(worker_id, model_key), keys.frames(model_key))]
    return len(shard.register_script(_REQUEUE_ON_SHARD)(keys=lists))
