"""app.cell_choice's reading of a cell's load: the same figures queue_depths and DrainMeter.drain give, in one
round trip without live GPU workers and two with (each cell's, a second, in every API process)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from app.cell_choice import CellLoads, Load
from app.drain import DrainMeter
from contract.jobs.backlog import queue_depths
from contract.redis.keys import Keys
from tests.test_retry_after import MODEL, Clock, answered, beat


class CountingConnection(redis.Connection):
    """A real connection that counts what it sends: one send a round trip (a pipeline is one)."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        super().send_packed_command(command, check_health)


@pytest.fixture
def counted(redis_client: redis.Redis) -> redis.Redis:
    kwargs = redis_client.connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=CountingConnection, **kwargs)
    return redis.Redis(connection_pool=pool)


def _round_trips(read: Any) -> tuple[Any, int]:
    before = CountingConnection.sent
    value = read()
    return value, CountingConnection.sent - before


def test_a_cells_load_is_read_in_one_round_trip_without_gpu_workers(counted):
    keys = Keys("loads")
    loads = CellLoads(counted, keys, ("",), heartbeat_ttl_s=10.0)
    for queue in keys.preprocess_queues(MODEL, ("",)):
        counted.rpush(keys.celery_queue(queue), "a", "b")
    counted.rpush(keys.frames(MODEL), "f")
    load, trips = _round_trips(lambda: loads._read(MODEL))
    assert load == Load(backlog=3, rate=None, unserved=True) and trips == 1
    assert sum(queue_depths(counted, keys, [MODEL])[MODEL].values()) == 3  # what the admission reads too


def test_a_cells_load_with_gpu_workers_is_drain_meters_in_two_round_trips(counted, redis_client):
    keys, clock = Keys("loads"), Clock()
    loads = CellLoads(counted, keys, ("",), heartbeat_ttl_s=10.0)
    loads.drains.clock = clock
    apart = DrainMeter(redis_client, keys, heartbeat_ttl_s=10.0, clock=clock)  # the reading it replaces
    beat(counted, keys, "a")
    beat(counted, keys, "other", model_key="n:1")  # live, but serving another model: not counted
    answered(counted, keys, "a", 10)
    answered(counted, keys, "other", 500, model_key=MODEL)
    first, trips = _round_trips(lambda: loads._read(MODEL))
    assert first == Load(backlog=0, rate=None, unserved=False) and trips == 2
    assert apart.drain(MODEL).rate is None
    clock.now += 1.0
    answered(counted, keys, "a", 30)
    assert loads._read(MODEL).rate == pytest.approx(20.0) == apart.drain(MODEL).rate
    assert loads._read("n:1") == Load(backlog=0, rate=None, unserved=False)
    assert loads._read("x:9").unserved and apart.drain("x:9").unserved  # no live worker serves it
