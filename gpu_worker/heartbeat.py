"""The GPU worker's heartbeat: it says the worker lives, fences a life presumed dead, and gives back a dead
worker's frames.

A worker beats every third of `heartbeat_ttl_s` (a key with that TTL, and its
score in the registry). It withholds the beat when its collect loop has
stalled, so a hung worker stops looking ready. On each beat it requeues the
frames of workers whose heartbeat expired (they died holding them); at start
it requeues the frames a previous life of itself left behind.

Fencing. Each life of a worker has an epoch (a token in Redis) that a reaper
deletes with the frames it takes back. A worker that was only paused past its
TTL (SIGSTOP, a stalled VM) and wakes up finds its epoch gone at its next beat:
it is `presumed_dead`, computes and writes nothing more (its batch write checks
the epoch in the same step), gives back what it took since, and exits for its
supervisor to start it again. Until a beat confirms its epoch after a silence
longer than the TTL, it computes nothing (`current`): the frames may be
another worker's by now.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from contract.cache.cache_plane import cache_plane
from contract.frames.frame_source import requeue_frames_of
from contract.library import Step
from contract.redis.clock import CLOCK
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.redis.shards import BulkPlane
from contract.settings import Settings
from contract.workers.heartbeat import Heartbeat
from contract.workers.scaling import backlogs, gpu_windows, scaling_signal
from gpu_worker import metrics

log = logging.getLogger("gpu_worker")


# The library's `gpu_beat` (contract/library/liveness.lua, where its keys and arguments are named).
_BEAT = Step("gpu_beat")


class WorkerIdInUse(RuntimeError):
    """Another live process serves under this worker id."""


class Liveness:
    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        keys: Keys,
        worker_id: str,
        describe: Callable[[], Heartbeat],
        last_progress: Callable[[], float],
        busy_fraction: Callable[[], float],
        on_presumed_dead: Callable[[], None] = lambda: None,
        bulk: BulkPlane | None = None,
        counters: Callable[[], dict[str, float]] = dict,
    ) -> None:
        """`counters`: the worker's counters hash as each beat writes it (gpu_worker.host_time.worker_counters)."""
        self.ttl_s = settings.gpu_worker.heartbeat_ttl_s
        # Every model configured, not only those this worker serves: a dead worker (or this one's previous
        # life) may have served others.
        self.model_keys = [spec.key for spec in settings.models]
        self.tenants = settings.tenants
        self.cache_max_bytes = settings.cache.max_bytes
        self.cache_plane = cache_plane(settings)  # the cache's own Redis, if it has one (its size read there)
        self.scaling = settings.scaling
        self.redis = client
        self.bulk = bulk or BulkPlane(client)
        self.keys = keys
        self.worker_id = worker_id
        self.describe = describe
        self.last_progress = last_progress
        self.busy_fraction = busy_fraction  # the GPU busy gauge is set here, off the batches' path
        self.on_presumed_dead = on_presumed_dead
        self.counters = counters
        self.epoch = ""
        self.presumed_dead = False
        self.confirmed_at = time.monotonic()  # the last time a beat found this life's epoch in Redis

    def begin_epoch(self) -> None:
        """A new life: its epoch, after the frames a previous one left were given back."""
        self.epoch = uuid.uuid4().hex
        self.redis.set(self.keys.gpu_epoch(self.worker_id), self.epoch)
        self.confirmed_at = time.monotonic()

    def current(self) -> bool:
        """Whether this life is still the worker's as far as it knows: confirmed within the TTL, not reaped."""
        return not self.presumed_dead and time.monotonic() - self.confirmed_at < self.ttl_s

    def claim(self, pid: int) -> None:
        """Refuse to serve beside a live worker of the same id: the two would requeue each other's frames
        and neither would ever be reaped. A heartbeat left by a process that died on this host, or by this
        very pid (a restarted container), is a previous life; any other is alive until it stops being
        refreshed, which a live worker does every third of the TTL."""
        key = self.keys.heartbeat(self.worker_id)
        info = Heartbeat.from_redis(self.redis.get(key))
        if info is None:
            return
        here = info.host == socket.gethostname()
        if here and (info.pid == pid or not _alive(info.pid)):
            return
        last = self.redis.pttl(key)
        deadline = time.monotonic() + self.ttl_s + 1.0
        while time.monotonic() < deadline:
            time.sleep(min(0.25, self.ttl_s / 12))
            remaining = self.redis.pttl(key)
            if remaining < 0:
                return  # it expired unrefreshed: that worker is gone
            if remaining > last:
                raise WorkerIdInUse(
                    f"worker id {self.worker_id!r} is in use by pid {info.pid} on "
                    f"{info.host}; give this worker its own --worker-id"
                )
            last = remaining

    def start(self, stopping: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self._loop, args=(stopping,), name="heartbeat", daemon=True)
        thread.start()
        return thread

    def _loop(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                self.beat()
                self.reap_dead_workers()
                self.count_frames_on_shards()
                self.export_backlog()
                metrics.GPU_BUSY.set(self.busy_fraction())
                self.export_cache_size()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            stopping.wait(self.ttl_s / 3.0)

    def export_backlog(self) -> None:
        """Per model, for Prometheus: the queues' depths, the backlog as the product sees it (queued, held by a CPU
        worker, frames) and the CPU worker processes it wants (contract.workers.scaling): an autoscaler's signal."""
        found = backlogs(self.redis, self.keys, self.model_keys, self.tenants)
        windows = gpu_windows(self.redis, self.keys, self.ttl_s)
        for model_key, backlog in found.items():
            name, _, version = model_key.partition(":")
            metrics.QUEUE_DEPTH.labels("preprocess", name, version).set(backlog.queued)
            metrics.QUEUE_DEPTH.labels("frames", name, version).set(backlog.frames)
            for where in ("queued", "held", "frames"):
                metrics.BACKLOG.labels(where, name, version).set(getattr(backlog, where))
            signal = scaling_signal(backlog, windows.get(model_key, []), self.scaling)
            metrics.CPU_WORKERS_WANTED.labels(name, version).set(signal.cpu_workers_wanted)

    def count_frames_on_shards(self) -> None:
        """With bulk shards: set each model's count of frames on them (Keys.frames_waiting) to what their lists
        hold. The pushes and batch writes keep it between beats; this mends what they cannot see (frames lost
        with a shard, given back, pushed twice). Between a beat and the acks of the frames then in GPU workers'
        hands it reads low by those frames, at most a few batches."""
        if self.bulk.sharded:
            counts: Any = self.bulk.frames_waiting(self.keys, self.model_keys)
            self.redis.hset(self.keys.frames_waiting, mapping=counts)

    def export_cache_size(self) -> None:
        """The result cache's entries and charged bytes, for Prometheus (one round trip). On a cache Redis of its own
        (no books there): its keys with a TTL and its used_memory, from its INFO (CachePlane.size); away, none: the
        gauges keep their last values."""

        def read(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.zcard(self.keys.cache_lru)
            pipe.get(self.keys.cache_bytes)
            return pipe.execute()

        limit = self.cache_max_bytes
        if self.cache_plane is None:
            entries, charged = read(self.redis)
        else:
            size = self.cache_plane.size()
            if size is None:
                return
            entries, charged, limit = size.entries, size.used_bytes, size.maxmemory
        metrics.CACHE_ENTRIES.set(int(entries))
        metrics.CACHE_BYTES.set(int(charged or 0))
        metrics.CACHE_MAX_BYTES.set(limit)

    def beat(self) -> None:
        """Publish that this worker lives (unless its loop has stalled), if its epoch is still there."""
        stall_limit = max(60.0, self.ttl_s * 6)
        stalled = time.monotonic() - self.last_progress() > stall_limit
        if stalled:
            log.error("main loop stalled for over %.0f s; withholding heartbeat", stall_limit)
        CLOCK.sync_if_due()
        asked_at = time.monotonic()
        alive = self._beat_step("" if stalled else self.describe().to_redis())
        if alive:
            self.confirmed_at = asked_at
        elif not self.presumed_dead:
            self.presumed_dead = True
            log.error(
                "this worker was presumed dead (silent past its heartbeat's %g s) and its frames were given "
                "to others: it computes and writes nothing more, and stops",
                self.ttl_s,
            )
            self.on_presumed_dead()

    def _beat_step(self, heartbeat: str) -> bool:
        """The step `gpu_beat`: the heartbeat's text ('' withholds it) and the counters, if the epoch is still this
        life's (whether it was)."""
        counters = [value for pair in self.counters().items() for value in pair]
        return bool(
            _BEAT(
                self.redis,
                [
                    self.keys.gpu_epoch(self.worker_id),
                    self.keys.heartbeat(self.worker_id),
                    self.keys.gpu_workers,
                    self.keys.gpu_counters(self.worker_id),
                ],
                [
                    self.epoch,
                    heartbeat,
                    int(self.ttl_s * 1000),
                    self.worker_id,
                    service_now(),
                    *counters,
                ],
            )
        )

    def requeue_own_frames(self, died: bool = True, model_keys: list[str] | None = None) -> int:
        """Frames this worker took but never answered go back first in line (of every model, or of
        `model_keys`). `died`: a previous life left them (an attempt is counted); else this life gives
        back what it is unsure of."""
        moved = self._requeue(self.worker_id, model_keys or self.model_keys, only_if_dead=False, count_attempt=died)
        if moved:
            log.warning(
                "requeued %d frames %s",
                moved,
                f"left by a previous run of {self.worker_id}" if died else "this worker gave back",
            )
        return moved

    def warn_of_lists_nobody_reads(self) -> list[str]:
        """Frame lists of models no longer configured (removed before they drained): their jobs will
        expire. Said at start, so whoever removed the version hears of it."""
        served = {self.keys.frames(model_key) for model_key in self.model_keys}
        pattern = self.keys.frames("*")
        orphans = []
        for raw in self.redis.scan_iter(match=pattern, count=1000, _type="list"):
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            waiting = 0 if key in served else self.redis.llen(key)
            if waiting:
                orphans.append(key)
                log.warning(
                    "%d frames wait on %s, a list no configured model reads (a version removed before "
                    "its list drained?); their jobs will expire",
                    waiting,
                    key,
                )
        return orphans

    def reap_dead_workers(self) -> int:
        """Requeue the frames of workers whose heartbeat expired (they died holding them)."""
        stale_before = service_now() - self.ttl_s
        moved = 0
        for raw_id in self.redis.zrangebyscore(self.keys.gpu_workers, "-inf", stale_before):
            worker_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            if worker_id == self.worker_id:
                continue
            count = self._requeue(worker_id, self.model_keys, only_if_dead=True)
            if count > 0:
                log.warning("requeued %d frames of dead GPU worker %s", count, worker_id)
                moved += count
        return moved

    def _requeue(self, worker_id: str, model_keys: list[str], only_if_dead: bool, count_attempt: bool = True) -> int:
        return requeue_frames_of(self.redis, self.keys, worker_id, model_keys, only_if_dead, count_attempt, self.bulk)

    def leave(self) -> None:
        """A worker that stops: its last counters (by the beat's step, so none from a fenced worker), then its
        heartbeat and epoch go."""
        try:
            if not self.presumed_dead:
                self._beat_step("")
            self.redis.delete(self.keys.heartbeat(self.worker_id), self.keys.gpu_epoch(self.worker_id))
            self.redis.zrem(self.keys.gpu_workers, self.worker_id)
        except redis.RedisError:
            pass


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
