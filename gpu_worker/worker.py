"""The GPU worker: one process per device, its stages overlapped so the device never waits on the host.

It serves one model or several (see lanes.py): each model has its own collect and stage threads and the
lanes share the device and finish threads. Per model:

    collect thread   batch N+1: pop (8 frames or 12 ms)                              (feeder.py)
    stage thread     batch N+1: unpack -> triage -> stage into a slot               (feeder.py)
    device thread    batch N: canvas -> forward -> post-processing -> detections back (devices.py)
    finish thread    batch N-1: result documents -> one Redis write with the ack      (finish.py)

Collecting and staging are one stage of the design split over two threads:
popping is mostly waiting on Redis and the network, and on its own thread that
wait overlaps the finish of the batch before. A lane holds at most one batch
ahead of the one on the device, popped just in time (as late as the host can
still take and stage it before the device is free): the frames after it wait in
the list, where a light key's go ahead of them (lanes.py: three ahead, at once,
when the host takes longer to stage a batch than half the device's time to run
it). A batch keeps gathering (up to its size) while the
device is busy. The device thread never touches Redis or JSON. Batches are
written in the order they were taken, which is what lets a write acknowledge
its frames by count.

On SIGTERM the collect thread stops taking frames and every batch already
taken runs to its write. A Redis error while collecting is followed by a
resync: the batches in hand are answered, then whatever else the processing
list holds goes back to the shared list. A batch that cannot be triaged is
still written in its turn: its frames go back to the list when Redis failed
(`give_back`), its jobs fail when something else did. `DeviceLost` (a fatal CUDA error)
stops the worker: finished batches are written, the frames in hand go back to
the list, and the process exits with EXIT_DEVICE_LOST for its supervisor.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import redis

from contract.cache import CacheLimits
from contract.frames.frame_shard_source import ShardedFrameSource
from contract.frames.frame_source import FrameSource, RedisFrameSource
from contract.jobs.ending import JobEnding
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.redis.shards import bulk_plane
from contract.settings import Settings
from contract.workers.heartbeat import Heartbeat
from gpu_worker import metrics
from gpu_worker.describe import describe_worker
from gpu_worker.devices import DeviceLost, inference_error
from gpu_worker.feeder import Feeder, InHand
from gpu_worker.finish import Finisher, result_documents
from gpu_worker.heartbeat import Liveness
from gpu_worker.host_time import HostTime, worker_counters
from gpu_worker.lanes import DeviceQueue, Lane
from gpu_worker.link import LaneMeters, WorkerLink
from gpu_worker.redis_patience import UntilRedisAnswers
from gpu_worker.stage_queue import StageQueue
from gpu_worker.staging import DETECTION_COLUMNS, Device, DeviceOutput
from gpu_worker.stats import BusyMeter, RecentStats

log = logging.getLogger("gpu_worker")

EXIT_DEVICE_LOST = 3
EXIT_PRESUMED_DEAD = 4  # paused past its heartbeat, its frames given to others: its supervisor starts it again
# Python hands the GIL over every 5 ms by default, as long as a fast batch runs on the device: a device thread
# waking from one would then wait up to a batch's length for it while the collect or finish thread runs Python.
# A short interval bounds that wait at a small cost in switches (docs/benchmarks/2026-12-02-feeding-a-fast-gpu.md).
GIL_SWITCH_INTERVAL_S = 0.0005
ROOM_POLL_S = 0.05  # how long the collect thread waits for room ahead of the device before looking at `stopping` again


def default_worker_id(device: Device) -> str:
    """Stable across restarts on one host and device, so a restarted worker finds its own frames, and
    distinct per GPU: by its UUID, not its index (every process that sees one GPU through
    CUDA_VISIBLE_DEVICES calls it cuda:0)."""
    return f"{socket.gethostname()}-{device.identity}"


class GpuWorker:
    def __init__(self, settings: Settings, client: redis.Redis, devices: Sequence[Device], worker_id: str) -> None:
        """`devices`: one per model served (each a model loaded on this worker's device)."""
        if not devices:
            raise ValueError("a GPU worker serves at least one model")
        self.settings = settings
        self.redis = client
        self.device = devices[0]  # the device they share (its name, utilisation and first model for the heartbeat)
        self.worker_id = worker_id
        self.keys = Keys(settings.namespace)
        # The jobs it ends `succeeded` leave their results in the result cache (contract.cache).
        self.bulk = bulk_plane(settings, client)  # where the frames lie (contract.redis.shards)
        self.store = JobEnding(
            client, self.keys, settings.jobs.ttl_s, bulk=self.bulk, cache=CacheLimits.of(settings, self.keys)
        )
        self.busy = BusyMeter(settings.gpu_worker.busy_window_s)
        self.recent = RecentStats()
        self.stopping = threading.Event()
        self.device_lost = False
        self.until_redis_answers = UntilRedisAnswers(self.stopping)  # gives up only while stopping
        seq = itertools.count(1)
        self.link = WorkerLink(
            settings,
            client,
            self.store,
            self.keys,
            worker_id,
            self.until_redis_answers,
            epoch=lambda: self.liveness.epoch,
            next_seq=lambda: next(seq),
        )
        self.lanes = [self._lane(index, device) for index, device in enumerate(devices)]
        self.to_device: DeviceQueue[InHand] = DeviceQueue(len(self.lanes))
        self.to_finish: StageQueue[tuple[Lane, InHand]] = StageQueue(1)
        self.liveness = Liveness(
            settings,
            client,
            self.keys,
            worker_id,
            self.describe,
            lambda: self.last_progress,
            self.busy.fraction,
            on_presumed_dead=self.stopping.set,
            bulk=self.bulk,
            counters=lambda: worker_counters(self.busy, self.recent, [lane.host_time for lane in self.lanes]),
        )
        self.started_at = service_now()
        self.last_progress = time.monotonic()

    def _lane(self, index: int, device: Device) -> Lane:
        host_time, recent = HostTime(), RecentStats()
        source: FrameSource[memoryview] = (
            ShardedFrameSource(self.bulk, self.keys, self.worker_id, device.spec.key)
            if self.bulk.sharded
            else RedisFrameSource(self.redis, self.keys, self.worker_id, device.spec.key)
        )
        feeder = Feeder(
            self.link,
            source,
            device,
            host_time,
            hold_open=lambda: self._lane_has_work_ahead(index),
            wait_held=lambda timeout_s: self.lanes[index].wait_for_ahead(timeout_s),
        )
        finisher = Finisher(self.link, device.spec, LaneMeters(host_time, recent, self.recent, self.busy), source)
        return Lane(index=index, device=device, feeder=feeder, finisher=finisher, host_time=host_time, recent=recent)

    # --- lifecycle -------------------------------------------------------
    def run(self) -> int:
        """Until SIGTERM/SIGINT (0) or a lost device (EXIT_DEVICE_LOST); WorkerIdInUse when another live
        worker has this one's id."""
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.until_redis_answers(lambda: self.liveness.claim(os.getpid()))
        self.warm_up()
        self.until_redis_answers(self.liveness.requeue_own_frames)
        self.until_redis_answers(self.liveness.begin_epoch)
        self.until_redis_answers(self.liveness.warn_of_lists_nobody_reads)
        self.liveness.start(self.stopping)
        threads = [
            thread
            for lane in self.lanes
            for thread in (
                threading.Thread(target=self._collect_loop, args=(lane,), name=f"collect-{lane.index}", daemon=True),
                threading.Thread(target=self._stage_loop, args=(lane,), name=f"stage-{lane.index}", daemon=True),
            )
        ]
        threads.append(threading.Thread(target=self._finish_loop, name="finish", daemon=True))
        for thread in threads:
            thread.start()
        log.info(
            "gpu worker %s serving %s on %s",
            self.worker_id,
            ", ".join(lane.spec.key for lane in self.lanes),
            self.device.name,
        )
        try:
            self._device_loop()
        finally:
            for thread in threads:
                thread.join()
            if self.device_lost or self.liveness.presumed_dead:
                # What it did not answer goes back: counted as a death when the device was lost; a paused worker's
                # frames taken since it woke up were never anyone else's (the reaper's went back already).
                self.until_redis_answers(
                    lambda: self.liveness.requeue_own_frames(
                        died=self.device_lost, model_keys=[lane.spec.key for lane in self.lanes]
                    )
                )
            if not self.until_redis_answers.abandoned:
                self.liveness.leave()
            log.info("gpu worker %s stopped after %d batches", self.worker_id, self.recent.batches_total)
        if self.device_lost:
            return EXIT_DEVICE_LOST
        return EXIT_PRESUMED_DEAD if self.liveness.presumed_dead else 0

    def warm_up(self) -> None:
        """Every batch size of every model through staging, the device and the documents before the first
        heartbeat says ready, so the first real batches pay no first-run costs; then the objects alive
        after start-up (torch's are many) are frozen out of the garbage collector's full passes, which
        otherwise stall the worker for tens of milliseconds now and then."""
        started = time.perf_counter()
        for lane in self.lanes:
            for frames in lane.device.warm_up(lane.feeder.collector.max_size):
                result_documents(np.empty((0, len(DETECTION_COLUMNS))), frames, lane.spec)
        gc.collect()
        gc.freeze()
        log.info("warmed up in %.2f s", time.perf_counter() - started)

    # --- the stages ------------------------------------------------------
    def _collect_loop(self, lane: Lane) -> None:
        try:
            while not self.stopping.is_set():
                # A batch is popped just before the device is free, not before: a batch held ahead only waits
                # longer, and its frames, left in the list, keep their place behind a light key's (Lane.pop_in_s).
                if not lane.wait_for_room_ahead(ROOM_POLL_S):
                    continue
                try:
                    batch = lane.feeder.collect()
                except Exception as exc:  # Redis, or anything unforeseen: answer what is in hand, then resync
                    log.warning(
                        "collecting a batch of %s failed (%s); resyncing",
                        lane.spec.key,
                        exc,
                        exc_info=not isinstance(exc, redis.RedisError),
                    )
                    try:
                        self._resync(lane)
                    except redis.RedisError:  # stopping with Redis away (logged): nothing more to take
                        break
                    continue
                self.last_progress = time.monotonic()
                if batch is not None:
                    lane.taken(lane.feeder.pop_s, full=len(batch[0]) >= lane.feeder.collector.max_size)
                    lane.to_stage.put(batch)  # (batch, the epoch it was taken in)
        finally:
            lane.to_stage.close()

    def _stage_loop(self, lane: Lane) -> None:
        try:
            for batch, epoch in lane.to_stage:
                lane.begin_staging()
                try:
                    in_hand = lane.feeder.prepare(batch, epoch)
                except Exception as exc:  # still written in its turn, so the order of the acks holds
                    log.warning("staging a batch failed (%s)", exc, exc_info=not isinstance(exc, redis.RedisError))
                    in_hand = lane.feeder.unprepared(batch, exc, epoch)
                finally:
                    lane.end_staging()
                self.to_device.put(lane.index, in_hand)
        finally:
            self.to_device.close(lane.index)

    def _device_loop(self) -> None:
        while (taken := self.to_device.take()) is not None:
            lane, batch = self.lanes[taken[0]], taken[1]
            lane.on_device()
            try:
                if batch.staged is not None and not self.device_lost:
                    self._wait_until_current()
                if self.device_lost or self.liveness.presumed_dead:
                    # Its frames stay in the processing list, given back at the exit (or another's already).
                    if batch.staged is not None:
                        lane.device.discard(batch.staged)
                    lane.done()
                    continue
                batch.started_at = max(batch.closed_at, service_now())
                if batch.staged is not None and not self._run_on_device(lane, batch):
                    lane.done()
                    continue
            finally:
                self.to_device.done()
                lane.off_device()  # the lane's next batch may be popped, its gathering one close
            self.to_finish.put((lane, batch))
        self.to_finish.close()

    def _wait_until_current(self) -> None:
        """Nothing goes on the device while this worker has been silent past its heartbeat's TTL (a pause, Redis
        away): its frames may be another worker's by now. The next beat says (gpu_worker.heartbeat)."""
        while not self.liveness.current() and not self.liveness.presumed_dead and not self.stopping.is_set():
            self.stopping.wait(0.02)

    def _run_on_device(self, lane: Lane, batch: InHand) -> bool:
        assert batch.staged is not None  # the caller runs only staged batches
        try:
            with lane.host_time("forward"):
                batch.output = lane.device.run(batch.staged)
        except DeviceLost as exc:
            log.critical("the device is lost (%s); giving the frames in hand back and exiting", exc)
            self.device_lost = True
            self.stopping.set()
            return False
        except Exception as exc:  # a defect around the model: the batch's jobs fail, the worker serves on
            log.exception("the device stage failed on batch %d", batch.seq, extra={"error_code": "inference_error"})
            batch.output = DeviceOutput(
                np.empty((0, len(DETECTION_COLUMNS))),
                0.0,
                0.0,
                0.0,
                {i: inference_error(exc) for i in range(len(batch.running))},
            )
        ended = time.monotonic()
        self.busy.record(ended - batch.output.device_s, ended)
        lane.ran(batch.output.device_s)
        metrics.DEVICE_SECONDS.labels(lane.spec.name, lane.spec.version).inc(batch.output.device_s)
        return True

    def _finish_loop(self) -> None:
        for lane, batch in self.to_finish:
            try:
                lane.finisher.finish(batch)
            except redis.RedisError:  # only once stopping (its retries gave up, logged): the frames stay in hand
                pass
            except Exception:  # a defect: the batch's jobs fail rather than stay running, and the order holds
                log.exception("finishing batch %d failed", batch.seq, extra={"error_code": "internal_error"})
                lane.finisher.fail_all(batch, "internal_error", "the GPU worker could not write this result")
            lane.done()

    def _lane_has_work_ahead(self, index: int) -> bool:
        """Batches of this model ahead of the one gathering: it can keep gathering, up to its size,
        meanwhile, for it could not run sooner. Another model's batch on the device does not hold it
        open: closed at its window, it takes its place in the device queue (see lanes.py); held open it
        would wait, unseen, while batches of the busy model overtook it."""
        lane = self.lanes[index]
        return (
            self.to_device.running == index or lane.staging or lane.to_stage.waiting() or self.to_device.waiting(index)
        )

    def _resync(self, lane: Lane) -> None:
        """After a failed call the lane's processing list may hold frames this worker does not know it
        took, or no longer means to answer: answer every batch of it in hand, then give back what is left."""
        lane.wait_until_answered()
        self.until_redis_answers(lambda: self.liveness.requeue_own_frames(died=False, model_keys=[lane.spec.key]))
        lane.feeder.source.forget()
        self.stopping.wait(1.0)

    # --- what the heartbeat says -----------------------------------------
    def describe(self) -> Heartbeat:
        return describe_worker(self.worker_id, self.started_at, self.device, self.lanes, self.busy, self.recent)
