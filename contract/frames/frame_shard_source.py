"""The frame lists over bulk shards (contract.redis.shards), out: contract.frames.frame_source's moves, a list per
shard.

`ShardedFrameSource` keeps a processing list per shard and acks there after the batch write (with the acked
frames' uploads, which a shard keeps until then); contract.frames.frame_source's `requeue_frames_of` gives a dead
worker's frames back on every shard that answers.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence

from contract.frames import read_job_id
from contract.frames.frame_source import RedisFrameSource, move_back
from contract.redis.keys import Keys
from contract.redis.shards import SHARD_ERRORS, BulkPlane

log = logging.getLogger(__name__)


class ShardedFrameSource:
    """One model's frame lists over the bulk shards, and this worker's processing list on each.

    Frames are taken from the shards that answer, one shard a look, in turn, and handed out in the order they
    were taken on each shard, so each shard's processing list keeps contract.frames.frame_source's order and `ack`
    still drops a batch's frames by count, per shard. While every list is empty, a thread per shard blocks on
    it (BLMOVE); a frame one of them brings after the wait ended is handed out first next time. A shard that
    fails is skipped for `bulk.retry_s`; before it is used again, once none of its frames is in hand, what is
    left in its processing list goes back (the worker may not know all it took there)."""

    acked_by_batch_write = False  # `ack` acks on the shards after the batch write (Finisher)

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
        # each time would keep each shard's CPU per image near one shard's, however many there are
        # (docs/benchmarks/2026-12-03-bulk-shards.md).
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
                move_back(self.bulk.clients[index], self.keys, self.worker_id, [self.model_key])
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

    def ack(self, count: int) -> None:
        """Drop the `count` oldest frames in hand from their shards' processing lists, and their uploads (kept
        until then: a CPU worker that died after its push leaves its job's task to be delivered again)."""
        by_shard: dict[int, list[str]] = {}
        for index, job_id in self._oldest(count):
            by_shard.setdefault(index, []).append(job_id)
        for index, job_ids in by_shard.items():
            uploads = [self.keys.upload(job_id) for job_id in job_ids if job_id]
            try:
                self.shards[index].ack(len(job_ids), uploads)
            except SHARD_ERRORS as exc:  # answered all the same; the list is given back before its next use
                self._failed(index, exc)

    def give_back(self, frames: Sequence[memoryview]) -> None:
        """The oldest frames in hand (these, in order) back to the front of their shards' lists."""
        by_shard: dict[int, list[memoryview]] = {}
        for (index, _), frame in zip(self._oldest(len(frames)), frames):
            by_shard.setdefault(index, []).append(frame)
        for index, taken in by_shard.items():
            try:
                self.shards[index].give_back(taken)
            except SHARD_ERRORS as exc:
                self._failed(index, exc)

    def forget(self) -> None:
        """After this worker gave back every shard's processing list: nothing is in hand."""
        with self.lock:
            self.in_hand.clear()
            for early in self.early:
                early.clear()
