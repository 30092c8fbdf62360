"""A bounded queue between two stages of the GPU worker, each in its own thread.

At most `capacity` items wait in it, so a fast stage cannot run ahead of a
slow one and memory stays bounded; the producer blocks in `put` until there
is room. `close()` ends it: the consumer's iteration takes what is still
waiting, then stops. That is how a shutdown runs the pipeline dry, stage by
stage, without dropping a batch that was already taken.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item")
_CLOSED = object()


class StageQueue(Generic[Item]):
    def __init__(self, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=capacity)

    def put(self, item: Item) -> None:
        self._queue.put(item)

    def close(self) -> None:
        """No more items; waits for room like `put`, so it never overtakes one."""
        self._queue.put(_CLOSED)

    def wait_for_room(self, timeout_s: float) -> bool:
        """Until an item could be put without waiting (True), or `timeout_s` passed (False)."""
        with self._queue.not_full:
            return self._queue.not_full.wait_for(lambda: len(self._queue.queue) < self._queue.maxsize, timeout_s)

    def waiting(self) -> bool:
        """Something is waiting for the consumer (the close marker does not count)."""
        with self._queue.mutex:
            return any(item is not _CLOSED for item in self._queue.queue)

    def __iter__(self) -> Iterator[Item]:
        while True:
            item = self._queue.get()
            if item is _CLOSED:
                return
            yield item  # type: ignore[misc]
