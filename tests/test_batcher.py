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
    assert batch.popped_at[1] == pytest.approx(100.012)  # the one look, at the window's end (light load: below)


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


def warmed(clock: FakeClock, batches: int = 6) -> BatchCollector:
    """A collector that has seen frames come fast (full batches back to back): a batch may fill in its window."""
    busy = collector(clock)
    for _ in range(batches):
        busy.collect(ScriptedSource(clock, [(clock.now, f"w{i}") for i in range(8)]))
    return busy


def test_at_light_load_a_window_costs_its_first_look_and_one_at_its_end():
    """No frames have been coming fast: whatever a look found mid-window, the batch would close at the window's end,
    so there is one look then (each frame asked of Redis is an LMOVE: 13 an image at light load before)."""
    clock = FakeClock()
    source = ScriptedSource(clock, [(100.001, "a"), (100.0041, "b"), (100.0042, "c"), (100.0081, "d")])
    batch = collector(clock).collect(source)
    assert batch.items == ["a", "b", "c", "d"] and batch.closed_by == CLOSED_BY_WINDOW
    assert batch.closed_at == pytest.approx(100.013)
    # the first look (a whole batch, for a new worker), the blocking pop's "a", a look for one more at once, then at
    # the window's end one (found), two (found), four (none: the list is empty, the batch closes)
    assert source.looks == [(8, 0), (1, 0), (1, 1), (2, 2), (4, 0)]


def test_a_look_that_found_all_it_asked_for_asks_for_twice_as_many_at_once():
    clock = FakeClock()
    busy = warmed(clock)
    source = ScriptedSource(clock, [(clock.now, f"f{i}") for i in range(20)])
    batch = busy.collect(source)
    assert len(batch.items) == 8 and batch.closed_at == batch.opened_at
    assert source.looks == [(8, 8)]  # the last batches found eight: a whole batch
    thin = collector(clock)
    thin._first_look = 1
    source = ScriptedSource(clock, [(clock.now, f"g{i}") for i in range(20)])
    assert len(thin.collect(source).items) == 8
    assert source.looks == [(1, 1), (2, 2), (4, 4), (1, 1)]  # 8 LMOVEs for 8 frames, in four round trips


def test_looks_that_find_nothing_come_further_apart_and_the_window_still_ends_with_one():
    """Frames have been coming fast enough to fill a batch within a window: looks come poll_s apart, then further
    apart while they find nothing (+1, +3, +7 ms), and one at the window's end."""
    clock = FakeClock()
    busy = warmed(clock)
    start = clock.now
    source = ScriptedSource(clock, [(start, "only"), (start + 0.0119, "just-in")])
    batch = busy.collect(source)
    assert batch.items == ["only", "just-in"] and batch.closed_by == CLOSED_BY_WINDOW
    assert batch.closed_at - batch.opened_at == pytest.approx(0.012, abs=1e-9)
    # the first, +1, +3, +7, and at +12 what the rate (~550 a second) brings in the 5 ms since the last look
    assert [asked for asked, _ in source.looks] == [8, 1, 1, 1, 3]


def test_a_batch_that_fills_mid_window_closes_within_one_interval_of_filling():
    clock = FakeClock()
    busy = warmed(clock)
    start = clock.now
    source = ScriptedSource(clock, [(start, "a"), *[(start + 0.0065, f"f{i}") for i in range(7)]])
    batch = busy.collect(source)
    assert len(batch.items) == 8 and batch.closed_by == CLOSED_BY_SIZE
    assert batch.closed_at == pytest.approx(start + 0.007)  # the look after +3 ms came at +7: within 4 ms of filling


def test_the_first_look_asks_for_twice_what_the_last_found():
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
    assert len(batch.items) == 8 and batch.closed_at == batch.opened_at


class CostlySource(ScriptedSource):
    """Each look costs the host 2 ms."""

    def pop_available(self, limit: int):
        self.clock.now += 0.002
        return super().pop_available(limit)


def test_the_host_time_of_a_batch_is_its_looks_not_its_waits_for_frames():
    """A batch held open behind the device fills as frames come (300 ms here): that wait is not the host's time. Counted
    as host time it made a slow device's lane look host-bound, and hold three batches ahead (gpu_worker.lanes)."""
    clock = FakeClock()
    source = CostlySource(clock, [(100.0 + i * 0.040, f"f{i}") for i in range(8)])
    held = collector(clock, hold_open=lambda: True, wait_held=clock.sleep, held_poll_s=0.005)
    batch = held.collect(source)
    assert len(batch.items) == 8 and batch.closed_at - batch.opened_at > 0.25
    assert held.busy_s == pytest.approx(0.002 * len(source.looks))
    assert held.busy_s < 0.5 * (batch.closed_at - batch.opened_at)  # what the whole collect call took, counted before
