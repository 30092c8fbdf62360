"""The models one GPU worker serves, side by side on one device.

Each model is a lane (its own lists, collect and stage threads, staging buffers, counters); the lanes
meet at the device, where `DeviceQueue` holds at most one staged batch per lane and serves the one that
has waited longest: round robin between busy models. Why this order and not the frames' age:
docs/architecture.md ("Lanes").
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from contract.settings.models import ModelSpec
from gpu_worker.batcher import Batch
from gpu_worker.feeder import Feeder
from gpu_worker.finish import Finisher
from gpu_worker.host_time import HostTime
from gpu_worker.stage_queue import StageQueue
from gpu_worker.staging import Device
from gpu_worker.stats import RecentStats

Item = TypeVar("Item")

# Batches of a lane taken and not yet on the device. One staged while one runs keeps the device busy when the host
# takes and stages a batch faster than the device runs one; more only wait longer for it, holding frames that, left
# in the list, a light key's would go ahead of. A host slower than its device needs its collect and stage threads
# overlapped, as deep as the pipeline goes (the stage queue, the stage thread, the device's slot).
MOST_BATCHES_AHEAD = 3
HOST_MARGIN = 2.0  # one batch ahead only while the host stages one in half the device's time: room for its hiccups
MEAN_WEIGHT = 0.2  # of a batch's timing in the lane's moving means


class DeviceQueue(Generic[Item]):
    """One slot per lane; `take` returns the item that was put first (ties: the lower lane)."""

    def __init__(self, lanes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.clock = clock
        self._slots: list[Item | None] = [None] * lanes
        self._put_at = [0.0] * lanes
        self._last: int | None = None  # the lane whose item the device took last
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
            if last is not None and self._slots[last] is not None:  # put while its predecessor ran
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
    feeder: Feeder
    finisher: Finisher
    host_time: HostTime
    recent: RecentStats
    to_stage: StageQueue[tuple[Batch[memoryview], str]] = field(default_factory=lambda: StageQueue(1))  # and its epoch
    staging: bool = False
    unanswered: int = 0
    answered: threading.Condition = field(default_factory=threading.Condition)
    ahead: int = 0  # batches taken, not yet taken by the device thread
    moved: threading.Condition = field(default_factory=threading.Condition)
    pop_s: float = 0.0  # the host's time to pop a whole batch, a moving mean
    stage_s: float = 0.0  # the stage thread's time on a batch (unpack, triage, stage), a moving mean
    staging_since: float = 0.0
    device_s: float = 0.0  # a batch's time on the device, a moving mean
    on_device_since: float | None = None  # monotonic: when the device took this lane's batch it holds (None: none)
    last_full: bool = False  # the last batch popped closed at its size: the list had a batch waiting
    # Set when this model's batch ahead of the gathering one leaves the device queue or the device.
    ahead_changed: threading.Event = field(default_factory=threading.Event)

    def wait_for_ahead(self, timeout_s: float) -> None:
        """The gathering batch's wait while held open: until the batch ahead moves, or the timeout."""
        self.ahead_changed.wait(timeout_s)
        self.ahead_changed.clear()

    @property
    def spec(self) -> ModelSpec:
        return self.device.spec

    def taken(self, pop_s: float = 0.0, full: bool = False) -> None:
        """A batch was popped, in `pop_s` of the host's time (0: not measured); `full`: it closed at its size."""
        with self.answered:
            self.unanswered += 1
        with self.moved:
            self.ahead += 1
            self.last_full = full
            if pop_s:
                self.pop_s = _moved(self.pop_s, pop_s)

    def on_device(self) -> None:
        """The device thread took one of its batches (to run, or to drop)."""
        with self.moved:
            self.ahead -= 1
            self.on_device_since = time.monotonic()
            self.moved.notify_all()

    def off_device(self) -> None:
        """The device is through with this lane's batch: the next may be popped, and the gathering one close."""
        with self.moved:
            self.on_device_since = None
            self.moved.notify_all()
        self.ahead_changed.set()

    def begin_staging(self) -> None:
        self.staging, self.staging_since = True, time.monotonic()

    def end_staging(self) -> None:
        self.staging = False
        with self.moved:
            self.stage_s = _moved(self.stage_s, time.monotonic() - self.staging_since)

    def ran(self, seconds: float) -> None:
        with self.moved:
            self.device_s = _moved(self.device_s, seconds)
            self.moved.notify_all()

    def room_ahead(self) -> int:
        """How many batches may wait for the device: enough that the next is staged by the time the device is free."""
        with self.moved:
            if not self.device_s:  # not measured yet: one, as a device at least as slow as its host needs
                return 1
            return 1 if HOST_MARGIN * (self.pop_s + self.stage_s) <= self.device_s else MOST_BATCHES_AHEAD

    def pop_in_s(self, now: float) -> float:
        """Seconds until the next batch may be popped: inf while room_ahead() batches wait for the device.

        One ahead, it is popped just in time: as late as the host can still take and stage it (and its window close)
        before the device is through with the batch it holds. A batch popped as soon as its predecessor reached the
        device sat staged for the whole of that batch, its frames taken before any a light key pushed meanwhile to
        the head of the list: that key's frame waited for the batch on the device, the staged one, then its own."""
        with self.moved:
            room = self.room_ahead()
            if self.ahead >= room:
                return math.inf
            if room > 1 or self.ahead or self.on_device_since is None:
                return 0.0
            # A batch that may not fill at once also needs its window to end before the device is free (held open
            # until then, it would keep gathering for what is left of its window); a saturated list fills it at once,
            # and each millisecond of lead is a light key's frame that comes too late for the next batch.
            window_s = 0.0 if self.last_full else self.feeder.collector.window_s
            lead = window_s + HOST_MARGIN * (self.pop_s + self.stage_s)
            return self.on_device_since + self.device_s - lead - now

    def wait_for_room_ahead(self, timeout_s: float) -> bool:
        """Until the next batch may be popped (True: see pop_in_s), or the timeout (False)."""
        deadline = time.monotonic() + timeout_s
        with self.moved:  # an RLock: pop_in_s takes it again
            while (wait_s := self.pop_in_s(now := time.monotonic())) > 0:
                if now >= deadline:
                    return False
                self.moved.wait(min(wait_s, deadline - now))
            return True

    def done(self) -> None:
        with self.answered:
            self.unanswered -= 1
            self.answered.notify_all()

    def wait_until_answered(self) -> None:
        with self.answered:
            self.answered.wait_for(lambda: self.unanswered == 0)


def _moved(mean: float, sample: float) -> float:
    """A moving mean with `sample` in; the first sample is the mean (from 0 the device's would look short for a
    while, and the lane hold three batches ahead)."""
    return sample if mean == 0.0 else mean + MEAN_WEIGHT * (sample - mean)
