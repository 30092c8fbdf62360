"""The batching window, on a fake clock: no Redis, no sleeps."""

from __future__ import annotations

import pytest

from gpu_worker.batcher import CLOSED_BY_SIZE, CLOSED_BY_WINDOW, CLOSED_LATE, BatchCollector


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


class ScriptedSource:
    """Frames that become available at given clock times."""

    def __init__(self, clock: FakeClock, arrivals: list[tuple[float, str]]) -> None:
        self.clock = clock
        self.pending = sorted(arrivals, key=lambda arrival: arrival[0])
        self.blocking_calls = 0
        self.looks: list[tuple[int, int]] = []  # (frames asked for, frames given)

    def pop_blocking(self, timeout_s: float):
        self.blocking_calls += 1
        if not self.pending:
            self.clock.now += timeout_s
            return None
        at, item = self.pending.pop(0)
        self.clock.now = max(self.clock.now, at)
        return item

    def pop_available(self, limit: int):
        ready = [item for at, item in self.pending if at <= self.clock.now][:limit]
        self.pending = [(at, item) for at, item in self.pending if item not in ready]
        self.looks.append((limit, len(ready)))
        return ready


def collector(clock: FakeClock, **kwargs) -> BatchCollector:
    return BatchCollector(max_size=8, window_s=0.012, poll_s=0.001, clock=clock, sleep=clock.sleep, **kwargs)


def test_closes_at_max_size_without_waiting_for_the_window():
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.0, f"f{i}") for i in range(20)])
    batch = collector(clock).collect(source)
    assert batch.items == [f"f{i}" for i in range(8)]
    assert batch.closed_by == CLOSED_BY_SIZE
    assert batch.closed_at == batch.opened_at


def test_closes_when_the_window_ends_with_what_arrived_inside_it():
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.0, "a"), (100.005, "b"), (100.011, "c"), (100.013, "late")])
    batch = collector(clock).collect(source)
    assert batch.items == ["a", "b", "c"]
    assert batch.closed_by == CLOSED_BY_WINDOW
    assert batch.closed_at - batch.opened_at == pytest.approx(0.012, abs=1e-9)
    assert source.pending == [(100.013, "late")]


def test_a_lone_frame_waits_exactly_the_window():
    clock = FakeClock()
    batch = collector(clock).collect(ScriptedSource(clock, [(100.0, "only")]))
    assert batch.items == ["only"]
    assert batch.closed_at - batch.opened_at == pytest.approx(0.012, abs=1e-9)


def test_a_first_frame_that_already_waited_a_window_does_not_wait_again():
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.0, "old"), (100.0, "also-there"), (100.003, "too-late")])
    batch = collector(clock, age_of=lambda item: 0.050 if item == "old" else 0.0).collect(source)
    assert batch.items == ["old", "also-there"]
    assert batch.closed_by == CLOSED_LATE
    assert batch.closed_at == batch.opened_at


def test_idle_list_gives_no_batch():
    clock = FakeClock()
    source = ScriptedSource(clock, [])
    assert collector(clock).collect(source) is None
    assert source.blocking_calls == 1


def test_pop_times_are_recorded_per_frame():
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.0, "a"), (100.004, "b")])
    batch = collector(clock).collect(source)
    assert batch.popped_at[0] == 100.0
    assert 100.004 <= batch.popped_at[1] <= 100.005


@pytest.mark.parametrize("kwargs", [{"max_size": 0, "window_s": 0.01}, {"max_size": 8, "window_s": -1}])
def test_arguments_are_validated_eagerly(kwargs):
    with pytest.raises(ValueError):
        BatchCollector(**kwargs)


def test_a_batch_stays_open_past_its_window_while_the_device_is_busy():
    clock = FakeClock()
    busy_until = 100.050
    source = ScriptedSource(clock, [(100.0, "a"), (100.030, "b"), (100.060, "late")])
    batch = collector(clock, hold_open=lambda: clock.now < busy_until).collect(source)
    assert batch.items == ["a", "b"]
    assert batch.closed_at == pytest.approx(100.050, abs=0.0011)


def test_a_held_batch_still_closes_when_full():
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.0 + i * 0.001, f"f{i}") for i in range(10)])
    batch = collector(clock, hold_open=lambda: True).collect(source)
    assert len(batch.items) == 8 and batch.closed_by == CLOSED_BY_SIZE


def test_a_look_that_found_nothing_asks_for_one_frame_next_and_one_that_found_some_for_all_the_room():
    """Under light load most looks find nothing: each frame asked for is a command for Redis."""
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.001, "a"), (100.0041, "b"), (100.0042, "c"), (100.0081, "d")])
    batch = collector(clock).collect(source)
    assert batch.items == ["a", "b", "c", "d"] and batch.closed_by == CLOSED_BY_WINDOW
    in_window = source.looks[1:]  # the first look, before the blocking pop, asks for a whole batch
    assert source.looks[0] == (8, 0)
    room = 7
    previous_found = True
    for asked, given in in_window:
        assert asked == (room if previous_found else 1)
        room -= given
        previous_found = given > 0
    assert sum(asked for asked, _ in in_window) < 3 * len(in_window)
