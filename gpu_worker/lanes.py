"""The models one GPU worker serves, side by side on one device.

Each model is a lane: its own frame list, processing list, collect and stage
threads, staging buffers and counters, so a batch never mixes models and each
model's batches are answered in the order they were taken (its acks go by
count, see source.py). The lanes meet at the device: `DeviceQueue` holds at
most one staged batch per lane and hands the device the one that has waited
for it longest.

That is the fairness the worker gives: first come, first served between
ready batches, one waiting batch per model, and a model's batch that became
ready while its previous batch ran counts as ready only when that run ends
(else a busy model, its next batch always staged ahead, would keep a second
turn in hand): round robin between models that are all busy. A quiet model's batch waits at most for the batch on
the device and one batch of each other model that was ready before it; a
flooded model's backlog waits in its own list, bounded by its own limits.
Ordering by the age of each batch's oldest frame (from when this worker took
it) starved the quiet model instead: a busy model's next batches are taken
from its list while its previous one still waits for the device, so they are
always older than a quiet model's fresh frame. Measured with the flood test
(tests/test_models.py): the quiet model's p95 was 844 ms that way.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

from contract.settings import ModelSpec
from gpu_worker.batcher import Batch
from gpu_worker.devices import Device
from gpu_worker.finish import Finisher
from gpu_worker.handoff import Handoff
from gpu_worker.intake import Intake
from gpu_worker.stages import StageClock
from gpu_worker.stats import RecentStats

Item = TypeVar("Item")


class DeviceQueue(Generic[Item]):
    """One slot per lane; `take` returns the item that was put first (ties: the lower lane)."""

    def __init__(self, lanes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.clock = clock
        self._slots: list[Item | None] = [None] * lanes
        self._put_at = [0.0] * lanes
        self._last: int | None = None   # the lane whose item the device took last
        # The lane whose item the device holds, from `take` (under the lock: no moment when it is neither
        # waiting nor running) to `done`.
        self.running: int | None = None
        self._closed = [False] * lanes
        self._changed = threading.Condition()

    def put(self, lane: int, item: Item) -> None:
        """Waits while the lane's previous item is still waiting: each lane runs at most one batch ahead."""
        with self._changed:
            self._changed.wait_for(lambda: self._slots[lane] is None)
            self._slots[lane] = item
            self._put_at[lane] = self.clock()
            self._changed.notify_all()

    def close(self, lane: int) -> None:
        """The lane sends no more; what it already put is still taken."""
        with self._changed:
            self._closed[lane] = True
            self._changed.notify_all()

    def waiting(self, lane: int | None = None) -> bool:
        """An item waits (of this lane, when given)."""
        with self._changed:
            if lane is not None:
                return self._slots[lane] is not None
            return any(slot is not None for slot in self._slots)

    def take(self) -> tuple[int, Item] | None:
        """The next item for the device, waiting for one; None once every lane is closed and empty."""
        with self._changed:
            self._changed.wait_for(lambda: any(slot is not None for slot in self._slots) or all(self._closed))
            last = self._last
            if last is not None and self._slots[last] is not None:   # put while its predecessor ran
                self._put_at[last] = max(self._put_at[last], self.clock())
            ready = [(self._put_at[lane], lane) for lane, slot in enumerate(self._slots) if slot is not None]
            if not ready:
                return None
            _, lane = min(ready)
            item = self._slots[lane]
            assert item is not None
            self._slots[lane] = None
            self._last = self.running = lane
            self._changed.notify_all()
            return lane, item

    def done(self) -> None:
        """The device is through with the item it took last."""
        with self._changed:
            self.running = None


@dataclass
class Lane:
    """One model on this worker: its stages' state, and the count of its batches taken, not yet written."""
    index: int
    device: Device
    intake: Intake
    finisher: Finisher
    clock: StageClock
    recent: RecentStats
    to_stage: Handoff[tuple[Batch[memoryview], str]] = field(default_factory=lambda: Handoff(1))   # and its epoch
    staging: bool = False
    unanswered: int = 0
    answered: threading.Condition = field(default_factory=threading.Condition)
    # Set when this model's batch ahead of the gathering one leaves the device queue or the device.
    ahead_changed: threading.Event = field(default_factory=threading.Event)

    def wait_for_ahead(self, timeout_s: float) -> None:
        """The gathering batch's wait while held open: until the batch ahead moves, or the timeout."""
        self.ahead_changed.wait(timeout_s)
        self.ahead_changed.clear()

    @property
    def spec(self) -> ModelSpec:
        return self.device.spec

    def taken(self) -> None:
        with self.answered:
            self.unanswered += 1

    def done(self) -> None:
        with self.answered:
            self.unanswered -= 1
            self.answered.notify_all()

    def wait_until_answered(self) -> None:
        with self.answered:
            self.answered.wait_for(lambda: self.unanswered == 0)
