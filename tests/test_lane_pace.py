"""When a GPU worker's lane may pop its next batch (gpu_worker.lanes.Lane.pop_in_s): no Redis, no processes."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from gpu_worker.lanes import MOST_BATCHES_AHEAD, Lane

WINDOW_S = 0.012


def lane() -> Lane:
    feeder: Any = SimpleNamespace(collector=SimpleNamespace(window_s=WINDOW_S))
    none: Any = None
    return Lane(index=0, device=none, feeder=feeder, finisher=none, host_time=none, recent=none)


def test_a_lane_whose_device_is_not_measured_yet_holds_one_batch_ahead_not_three():
    fresh = lane()
    fresh.taken(pop_s=0.4)  # even after a slow first pop: one ahead until a batch ran
    assert fresh.room_ahead() == 1 and fresh.pop_in_s(0.0) == math.inf
    fresh.on_device()
    assert fresh.on_device_since is not None
    assert fresh.pop_in_s(fresh.on_device_since) <= 0  # device time unknown: pops at once


def test_one_ahead_the_next_batch_is_popped_just_before_the_device_is_free():
    slow = lane()
    slow.taken(pop_s=0.002)
    slow.ran(1.0)  # the device: 1 s a batch; the host: 2 ms to pop, 3 ms to stage
    slow.stage_s = 0.003
    slow.on_device()
    started = slow.on_device_since
    assert started is not None
    lead = WINDOW_S + 2 * (0.002 + 0.003)
    assert slow.pop_in_s(started) == pytest.approx(1.0 - lead)
    assert slow.pop_in_s(started + 1.0 - lead) == pytest.approx(0.0)
    slow.taken(pop_s=0.002, full=True)  # the list had a whole batch waiting: saturated, no window to wait out
    slow.on_device()
    assert slow.pop_in_s(started) == pytest.approx(1.0 - 2 * (0.002 + 0.003), abs=0.01)
    slow.off_device()  # done early: at once
    assert slow.pop_in_s(started + 0.1) == 0.0
    assert slow.wait_for_room_ahead(0.0)


def test_a_host_slower_than_half_its_device_keeps_three_ahead_and_pops_at_once():
    busy_host = lane()
    busy_host.taken(pop_s=0.004)
    busy_host.ran(0.006)  # 6 ms a batch, the host 4 ms to pop alone
    busy_host.on_device()
    assert busy_host.room_ahead() == MOST_BATCHES_AHEAD
    assert busy_host.pop_in_s(0.0) == 0.0
    busy_host.taken()
    busy_host.taken()
    busy_host.taken()
    assert busy_host.pop_in_s(0.0) == math.inf  # three wait for the device
