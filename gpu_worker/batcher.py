"""Dynamic batching: close a batch at `max_size` frames or `window_s` after its
first frame was popped, whichever comes first.

The window runs on this process's own clock: Redis's blocking timeouts are
about 100 ms coarse, far too coarse for a 12 ms window. A first frame that
already waited a full window in the list does not wait again: the batch takes
what is there and closes at once.

While `hold_open()` says the device is still busy with the previous batch, a
batch that is not full stays open past its window and keeps gathering: closing
it early would only make it wait, smaller, for the same device. Meanwhile it
looks for frames every `held_poll_s` through `wait_held`, which the worker
wakes as soon as the batch ahead is done: polling Redis every millisecond for
the whole of a long batch cost the worker and Redis more than the rest of a
batch's host work.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from contract.documents import ClosedBy
from contract.frames.frame_source import FrameSource

Item = TypeVar("Item")

CLOSED_BY_SIZE = ClosedBy.FULL
CLOSED_BY_WINDOW = ClosedBy.WINDOW
CLOSED_LATE = ClosedBy.LATE  # the first frame had already waited a window in the list


@dataclass
class Batch(Generic[Item]):
    items: list[Item]
    opened_at: float  # clock time the first frame was popped
    closed_at: float
    closed_by: str
    popped_at: list[float] = field(default_factory=list)  # clock time each item was popped

    def __len__(self) -> int:
        return len(self.items)


class BatchCollector(Generic[Item]):
    """Gathers one batch at a time from a FrameSource (contract.frames.frame_source): its two pops."""

    def __init__(
        self,
        max_size: int,
        window_s: float,
        *,
        idle_timeout_s: float = 1.0,
        poll_s: float = 0.001,
        age_of: Callable[[Item], float] = lambda _: 0.0,
        hold_open: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        held_poll_s: float | None = None,
        wait_held: Callable[[float], None] | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        if poll_s <= 0 or idle_timeout_s <= 0:
            raise ValueError("poll_s and idle_timeout_s must be > 0")
        self.max_size = max_size
        self.window_s = window_s
        self.idle_timeout_s = idle_timeout_s
        self.poll_s = poll_s
        self.age_of = age_of
        self.hold_open = hold_open
        self.clock = clock
        self.sleep = sleep
        self.held_poll_s = held_poll_s if held_poll_s is not None else poll_s
        if self.held_poll_s <= 0:
            raise ValueError("held_poll_s must be > 0")
        self.wait_held = wait_held or sleep
        # The last batch's host time in its looks (non-blocking pops): what the host spends to take a batch, without
        # its waits for frames (a first frame, the window, a batch held open behind the device)
        self.busy_s = 0.0
        self._first_look = max_size  # frames the first look of the next batch asks for (collect)
        self._rate = 0.0  # frames a second, as batches have been finding them (_observe)
        self._last_closed: float | None = None

    def collect(self, source: FrameSource[Item]) -> Batch[Item] | None:
        """Take what is there (one round trip when the list is full), else block for a first frame
        (up to idle_timeout_s); then fill the batch.

        Each frame asked of Redis is an LMOVE whether it is there or not, so a look asks for what is likely there:
        the first look for twice what the last batch's found (a whole batch was eight LMOVEs for one frame at light
        load); a look that found all it asked for is followed at once by one for twice as many (a full list is
        drained in a few round trips, with at most one frame's LMOVEs more than it held); one that found less left
        the list empty, and the next waits. While the
        batch may still fill before its window ends at the rate frames have been coming, looks come poll_s apart,
        then further apart while they find nothing (a batch that fills closes at most one interval later);
        otherwise the batch would close at the window's end whatever a look found before it, so there is one look,
        at the end, for what that rate brings in a window. 13 LMOVEs an image at light load before."""
        first_look = self._first_look
        looked = self.clock()
        items = list(source.pop_available(first_look))
        self.busy_s = self.clock() - looked
        self._first_look = min(self.max_size, max(1, 2 * len(items)))
        ask = min(self.max_size - len(items), 2 * first_look) if len(items) == first_look else 0  # 0: wait first
        if not items:
            first = source.pop_blocking(self.idle_timeout_s)
            if first is None:
                return None
            items, ask = [first], 1  # more may have come with it: one look, for one, at once
        opened_at = self.clock()
        late = self.age_of(items[0]) >= self.window_s
        deadline = opened_at if late else opened_at + self.window_s
        popped_at = [opened_at] * len(items)
        interval = self.poll_s
        looked_at = opened_at
        while len(items) < self.max_size:
            if not ask:
                now = self.clock()
                held = self.hold_open()
                if now >= deadline and not held:
                    break
                if held:
                    self.wait_held(self.held_poll_s)
                    ask = 1
                elif self._may_fill(len(items), deadline - now):
                    self.sleep(min(interval, deadline - now))
                    interval *= 2
                    ask = 1
                else:  # what that rate brings until the window's end, since the last look
                    self.sleep(deadline - now)
                    ask = min(self.max_size - len(items), max(1, math.ceil(self._rate * (deadline - looked_at))))
            looked = self.clock()
            more = source.pop_available(ask)
            now = looked_at = self.clock()
            self.busy_s += now - looked
            items.extend(more)
            popped_at.extend([now] * len(more))
            if more:
                interval = self.poll_s
            found_all = len(more) == ask
            ask = min(self.max_size - len(items), 2 * ask) if found_all else 0
            if len(items) >= self.max_size or (now >= deadline and not found_all and not self.hold_open()):
                break
        self._observe(len(items), self.clock())
        closed_by = CLOSED_BY_SIZE if len(items) >= self.max_size else (CLOSED_LATE if late else CLOSED_BY_WINDOW)
        return Batch(items=items, opened_at=opened_at, closed_at=self.clock(), closed_by=closed_by, popped_at=popped_at)

    def _may_fill(self, count: int, left_s: float) -> bool:
        """Whether a batch of `count` may fill within `left_s` at twice the rate frames have been coming."""
        return count + 2.0 * self._rate * left_s >= self.max_size

    def _observe(self, count: int, closed_at: float) -> None:
        """The rate frames come at: a moving mean of each batch's frames over the time since the batch before it
        closed (at least a window)."""
        if self._last_closed is not None:
            sample = count / max(closed_at - self._last_closed, self.window_s, 1e-6)
            self._rate = 0.7 * self._rate + 0.3 * sample
        self._last_closed = closed_at
