"""What travels together to a lane's feeder and finisher: the worker they belong to, and the meters a
lane keeps. The worker (gpu_worker.worker) builds one WorkerLink and one LaneMeters per lane."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from contract.jobs.ending import JobEnding
from contract.redis.keys import Keys
from contract.settings import Settings
from gpu_worker.host_time import HostTime
from gpu_worker.stats import BusyMeter, RecentStats


@dataclass(frozen=True)
class WorkerLink:
    """The worker as its lanes' parts see it: who it is, where it writes, and what only it can answer."""

    settings: Settings
    redis: redis.Redis
    store: JobEnding
    keys: Keys
    worker_id: str
    retry: Callable[[Callable[[], Any]], Any]  # run an action until Redis answers (or the worker stops)
    epoch: Callable[[], str]  # the worker's life now: a batch is written only in its own
    next_seq: Callable[[], int]  # batch numbers, shared by every model it serves


@dataclass(frozen=True)
class LaneMeters:
    """One lane's clocks and windows, beside the worker's that every lane feeds."""

    host_time: HostTime  # this lane's host time by stage
    recent: RecentStats  # this model's recent jobs on this worker
    worker_recent: RecentStats
    busy: BusyMeter  # the device's busy time, the worker's
