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
    assert batch.popped_at[1] == pytest.approx(100.007)  # the look that took it: at +1, +3, +7 ms (see below)


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


def test_a_look_that_found_all_it_asked_for_asks_for_all_the_room_next_and_any_other_for_one_frame():
    """Under light load most looks find nothing: each frame asked for is a command for Redis."""
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.001, "a"), (100.0041, "b"), (100.0042, "c"), (100.0081, "d")])
    batch = collector(clock).collect(source)
    assert batch.items == ["a", "b", "c", "d"] and batch.closed_by == CLOSED_BY_WINDOW
    in_window = source.looks[1:]  # the first look, before the blocking pop, asks for a whole batch
    assert source.looks[0] == (8, 0)
    room = 7
    previous = (1, 1)  # the blocking pop: one asked, one found
    for asked, given in in_window:
        assert asked == (room if previous[1] == previous[0] else 1)
        room -= given
        previous = (asked, given)
    assert sum(asked for asked, _ in in_window) < 3 * len(in_window)


def test_looks_that_find_nothing_come_further_apart_and_the_window_still_ends_with_one():
    """A window in which nothing more comes: looks at +1, +3, +7 ms and at its end (+12), not one every
    millisecond (each look is an LMOVE for Redis: 13 an image at light load before)."""
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.0, "only"), (100.0119, "just-in")])
    batch = collector(clock).collect(source)
    assert batch.items == ["only", "just-in"] and batch.closed_by == CLOSED_BY_WINDOW
    assert batch.closed_at - batch.opened_at == pytest.approx(0.012, abs=1e-9)
    assert len(source.looks) == 5  # the first (found "only"), then +1, +3, +7, +12


def test_a_batch_that_fills_mid_window_closes_within_one_interval_of_filling():
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.0, "a"), *[(100.0065, f"f{i}") for i in range(7)]])
    batch = collector(clock).collect(source)
    assert len(batch.items) == 8 and batch.closed_by == CLOSED_BY_SIZE
    assert batch.closed_at == pytest.approx(100.007)  # the look after +3 ms came at +7: within 4 ms of filling


def test_the_first_look_asks_for_twice_what_the_last_found_and_a_full_list_is_still_drained_at_once():
    clock = FakeClock()
    batches = collector(clock)
    source = ScriptedSource(clock, [(100.0, "lone")])
    batches.collect(source)
    assert source.looks[0] == (8, 1)  # a new worker looks for a whole batch
    source = ScriptedSource(clock, [(clock.now + 0.5, "after-a-pause")])
    batches.collect(source)
    assert source.looks[0] == (2, 0)  # twice the one found last time; nothing there: the blocking pop took it
    source = ScriptedSource(clock, [(clock.now, f"f{i}") for i in range(20)])
    batch = batches.collect(source)
    assert source.looks[0] == (1, 1)  # after a look that found none, one frame
    assert len(batch.items) == 8 and source.looks[1] == (7, 7)  # then the whole room, in the same batch
    assert batch.closed_at == batch.opened_at
