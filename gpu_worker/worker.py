"""The GPU worker: one process per device, draining the frame list in batches.

A feeder thread collects a batch (<= max frames, <= window), marks its jobs
running (dropping cancelled and expired ones) and assembles one tensor on the
device while the main thread runs the previous batch; the main thread runs the
model, post-processes the whole batch at once, then writes every result and
acknowledges the frames in a single Redis transaction.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import redis

from contract import jobs
from contract.frames import Frame, FrameError, read_job_id, unpack_frame
from contract.keys import Keys
from contract.settings import Settings
from contract.timebill import compute_time_bill
from gpu_worker import metrics
from gpu_worker.batcher import Batch, BatchCollector
from gpu_worker.inference import BatchRunner, PreparedInputs
from gpu_worker.model import LoadedModel
from gpu_worker.source import RedisFrameSource, requeue_frames_of
from gpu_worker.stats import BusyMeter, RecentStats, nvml_utilisation

log = logging.getLogger("gpu_worker")


def default_worker_id(model: LoadedModel) -> str:
    """Stable across restarts on one host and device, so a restarted worker finds its own frames."""
    device = "sim" if model.simulated else str(model.device).replace(":", "")
    return f"{socket.gethostname()}-{device}"


@dataclass
class InFlight:
    """One frame of the batch in hand, with its wall-clock stamps."""
    frame: Frame
    popped_at: float
    index: int = 0            # position among the batch's running jobs, set once triage is done


@dataclass
class Prepared:
    """A collected batch, triaged and assembled, waiting for the device."""
    batch: Batch[bytes]
    items: list[InFlight]
    inputs: PreparedInputs | None
    seq: int
    closed_at: float          # wall clock
    started_at: float = 0.0   # wall clock: its turn on the device began

    def turn_started(self) -> float:
        """Now, less the assembly done ahead (billed to infer), but never before the batch closed."""
        assembled_s = self.inputs.assemble_ms / 1000.0 if self.inputs is not None else 0.0
        return max(self.closed_at, time.time() - assembled_s)


class GpuWorker:
    def __init__(self, settings: Settings, client: redis.Redis, model: LoadedModel, worker_id: str) -> None:
        self.settings = settings
        self.redis = client
        self.model = model
        self.worker_id = worker_id
        self.keys = Keys(settings.namespace)
        self.store = jobs.JobStore(client, self.keys, settings.jobs.ttl_s)
        self.source = RedisFrameSource(client, self.keys, worker_id)
        batching = settings.batching
        self.collector: BatchCollector[bytes] = BatchCollector(
            batching.max_batch_size, batching.window_ms / 1000.0,
            idle_timeout_s=batching.idle_poll_s, poll_s=batching.gather_poll_ms / 1000.0,
            age_of=_frame_age, hold_open=self._device_has_work)
        self.busy = BusyMeter(settings.gpu_worker.busy_window_s)
        self.runner = BatchRunner(model, settings.gpu_worker.max_candidates, self.busy)
        self.recent = RecentStats()
        self.stopping = threading.Event()
        self.ready: queue.Queue[Prepared] = queue.Queue(maxsize=1)
        self.device_idle = threading.Event()   # set while the main thread waits for a batch
        self.device_idle.set()
        self.batch_seq = 0
        self.started_at = time.time()
        self.last_progress = time.monotonic()

    # --- lifecycle -------------------------------------------------------
    def run(self) -> None:
        """A feeder thread collects and assembles batch N+1 while this thread runs batch N."""
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        self.requeue_own_frames()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        feeder = threading.Thread(target=self._feed_loop, name="feeder", daemon=True)
        feeder.start()
        log.info("gpu worker %s serving %s on %s", self.worker_id, self.model.spec.name,
                 "sim" if self.model.simulated else self.model.device)
        try:
            # On SIGTERM the feeder stops taking frames; batches already taken are finished first.
            while feeder.is_alive() or not self.ready.empty():
                try:
                    prepared = self.ready.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._answer_safely(prepared)
        finally:
            self._leave()

    def _feed_loop(self) -> None:
        while not self.stopping.is_set():
            batch = None
            try:
                batch = self.collector.collect(self.source)
                self.last_progress = time.monotonic()
                if batch is not None:
                    self._hand_over(self.prepare(batch))
            except redis.RedisError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                if batch is not None:   # taken but not triaged: back to the front of the line
                    self._retry_until_redis_answers(lambda: self.source.give_back(batch.items))
                self.stopping.wait(1.0)

    def _device_has_work(self) -> bool:
        """A batch runs, or one is already prepared and waiting: the next one can keep gathering."""
        return not self.device_idle.is_set() or not self.ready.empty()

    def _hand_over(self, prepared: "Prepared") -> None:
        while True:   # never block a shutdown
            try:
                self.ready.put(prepared, timeout=0.2)
                return
            except queue.Full:
                continue

    def _answer_safely(self, prepared: "Prepared") -> None:
        """Run the batch once; its results wait in memory until Redis takes them.

        The device counts as free from the end of the forward: the feeder closes
        and assembles the next batch while this thread writes results."""
        prepared.started_at = prepared.turn_started()
        self.device_idle.clear()
        try:
            results = self._infer(prepared.items, prepared.inputs) if prepared.items else {}
        finally:
            self.device_idle.set()
        self._retry_until_redis_answers(lambda: self.write_results(prepared, results))

    def _retry_until_redis_answers(self, action) -> None:
        delay = 0.2
        while True:
            try:
                return action()
            except redis.RedisError as exc:
                log.warning("redis unavailable (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def requeue_own_frames(self) -> int:
        """Frames a previous life of this worker took but never answered go back first in line."""
        moved = requeue_frames_of(self.redis, self.keys, self.worker_id, only_if_dead=False)
        if moved:
            log.warning("requeued %d frames left by a previous run of %s", moved, self.worker_id)
        return moved

    def reap_dead_workers(self) -> int:
        """Requeue the frames of workers whose heartbeat expired (they died holding them)."""
        stale_before = time.time() - self.settings.gpu_worker.heartbeat_ttl_s
        moved = 0
        for raw_id in self.redis.zrangebyscore(self.keys.gpu_workers, "-inf", stale_before):
            worker_id = raw_id.decode()
            if worker_id == self.worker_id:
                continue
            count = requeue_frames_of(self.redis, self.keys, worker_id, only_if_dead=True)
            if count > 0:
                log.warning("requeued %d frames of dead GPU worker %s", count, worker_id)
                moved += count
        return moved

    # --- one batch -------------------------------------------------------
    def prepare(self, batch: Batch[bytes]) -> "Prepared":
        """Triage the frames (one round trip) and assemble the input of the jobs still wanted."""
        self.batch_seq += 1
        offset = time.time() - time.monotonic()
        pipe = self.redis.pipeline(transaction=False)
        candidates = self._triage(batch, offset, pipe)
        replies = pipe.execute()
        verdicts = replies[len(replies) - len(candidates):]
        running = [item for item, verdict in zip(candidates, verdicts) if verdict == jobs.MOVED]
        self._fail_poisoned([item for item, verdict in zip(candidates, verdicts) if verdict == jobs.POISON])
        for index, item in enumerate(running):
            item.index = index
        inputs = None
        if running:
            try:
                inputs = self.runner.prepare([item.frame for item in running])
            except Exception as exc:   # e.g. a frame whose geometry does not fit: sorted out in _infer
                log.warning("cannot assemble batch %d (%s)", self.batch_seq, exc)
        return Prepared(batch=batch, items=running, inputs=inputs, seq=self.batch_seq,
                        closed_at=batch.closed_at + offset)

    def _fail_poisoned(self, items: list[InFlight]) -> None:
        if not items:
            return
        pipe = self.redis.pipeline(transaction=False)
        for item in items:
            job_id = item.frame.header.job_id
            log.error("poison frame: GPU workers died holding it %d times", self.settings.gpu_worker.max_attempts,
                      extra={"job_id": job_id})
            self.store.fail(job_id, "poison", "the job's frame was in hand each time a GPU worker died "
                                              f"({self.settings.gpu_worker.max_attempts} times); not trying again",
                            client=pipe)
        pipe.execute()

    def write_results(self, prepared: "Prepared", results: dict[str, dict[str, Any]]) -> None:
        """Every result and time bill, and the frames' ack, in one transaction."""
        batch, running = prepared.batch, prepared.items
        pipe = self.redis.pipeline(transaction=True)
        for item in running:
            self._finish(item, results[item.frame.header.job_id], prepared, len(running), pipe)
        self.source.ack(batch.items, client=pipe)
        pipe.hset(self.keys.gpu_counters(self.worker_id), mapping=self._counters(len(batch.items)))
        pipe.execute()
        self.recent.record_batch(len(batch.items))
        metrics.observe_batch(len(batch.items), len(running), batch.closed_at - batch.opened_at)
        metrics.GPU_BUSY.set(self.busy.fraction())

    def _triage(self, batch: Batch[bytes], offset: float, pipe: Any) -> list[InFlight]:
        """Unpack frames; fail the unreadable, expire the late; queue a running-unless-poisoned
        move for the rest, whose replies end the pipeline."""
        now = time.time()
        candidates: list[InFlight] = []
        for raw, popped in zip(batch.items, batch.popped_at):
            try:
                frame = unpack_frame(raw)
            except FrameError as exc:
                job_id = read_job_id(raw)
                log.error("bad frame: %s", exc, extra={"job_id": job_id})
                if job_id:
                    self.store.fail(job_id, "bad_frame", str(exc), client=pipe)
                continue
            if now > frame.header.deadline_at:
                self.store.finish(frame.header.job_id, jobs.EXPIRED,
                                  {"error": {"code": "deadline", "message": "expired before inference"}},
                                  client=pipe)
                metrics.FRAMES_EXPIRED.inc()
                continue
            candidates.append(InFlight(frame=frame, popped_at=popped + offset))
        for item in candidates:
            self.store.advance_unless_poisoned(item.frame.header.job_id, jobs.RUNNING,
                                               self.settings.gpu_worker.max_attempts, client=pipe)
        return candidates

    def _infer(self, items: Sequence[InFlight], inputs: PreparedInputs | None = None) -> dict[str, dict[str, Any]]:
        """job id -> {"result": ..., "infer_ms", "postprocess_ms"} or {"error": ...}.

        A batch that raises is retried one frame at a time, so one poison
        frame fails alone and its batch-mates still get answers.
        """
        try:
            return self._infer_batch(items, inputs)
        except Exception as exc:  # the model may raise anything
            if len(items) == 1:
                job_id = items[0].frame.header.job_id
                log.exception("inference failed", extra={"job_id": job_id})
                return {job_id: {"error": {"code": "inference_error", "message": str(exc)[:500]}}}
            log.warning("batch of %d failed (%s); retrying frames one by one", len(items), exc)
            outcomes: dict[str, dict[str, Any]] = {}
            for item in items:
                outcomes.update(self._infer([item]))
            return outcomes

    def _infer_batch(self, items: Sequence[InFlight], inputs: PreparedInputs | None) -> dict[str, dict[str, Any]]:
        frames = [item.frame for item in items]
        if inputs is None:
            inputs = self.runner.prepare(frames)
        run = self.runner.execute(frames, inputs, on_device_done=self.device_idle.set)
        metrics.DEVICE_SECONDS.inc(run.device_s)
        return {frame.header.job_id: {"result": doc, "infer_ms": run.infer_ms, "postprocess_ms": run.postprocess_ms}
                for frame, doc in zip(frames, run.documents)}

    def _finish(self, item: InFlight, outcome: dict[str, Any], prepared: "Prepared", size: int,
                pipe: Any) -> None:
        header = item.frame.header
        stamps = {**header.stamps, "popped_at": item.popped_at, "batch_closed_at": prepared.started_at,
                  "finished_at": time.time()}
        stamps.update({k: outcome[k] for k in ("infer_ms", "postprocess_ms") if k in outcome})
        bill = compute_time_bill(stamps)
        self.recent.record_bill(bill)
        metrics.observe_bill(bill)
        fields = {
            "timings": bill,
            "batch": {"id": f"{self.worker_id}:{prepared.seq}", "seq": prepared.seq, "size": size,
                      "index": item.index, "closed_by": prepared.batch.closed_by, "worker": self.worker_id},
        }
        log.info("job answered", extra={"job_id": header.job_id, "batch": fields["batch"]["id"],
                                        "total_ms": fields["timings"].get("total")})
        if "error" in outcome:
            self.store.finish(header.job_id, jobs.FAILED, {**fields, "error": outcome["error"]}, client=pipe)
        else:
            self.store.finish(header.job_id, jobs.SUCCEEDED, {**fields, "result": outcome["result"]},
                              client=pipe)

    def _counters(self, batch_size: int) -> dict[str, float]:
        """Running totals including the batch being written."""
        return {"device_seconds_total": round(self.busy.total_s, 6),
                "batches_total": self.recent.batches_total + 1,
                "frames_total": self.recent.frames_total + batch_size, "updated_at": time.time()}

    # --- liveness --------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = self.settings.gpu_worker.heartbeat_ttl_s / 3.0
        while not self.stopping.is_set():
            try:
                self.beat()
                self.reap_dead_workers()
                self._export_queue_depths()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self.stopping.wait(interval)

    def _export_queue_depths(self) -> None:
        for queue_name, depth in jobs.queue_depths(self.redis, self.keys).items():
            metrics.QUEUE_DEPTH.labels(queue_name).set(depth)

    def beat(self) -> None:
        """Publish that this worker lives, unless its loop has stalled."""
        stall_limit = max(60.0, self.settings.gpu_worker.heartbeat_ttl_s * 6)
        if time.monotonic() - self.last_progress > stall_limit:
            log.error("main loop stalled for over %.0f s; withholding heartbeat", stall_limit)
            return
        ttl = self.settings.gpu_worker.heartbeat_ttl_s
        info = {"worker_id": self.worker_id, "pid": os.getpid(), "host": socket.gethostname(),
                "started_at": self.started_at, "model": self.model.describe(),
                "batching": {"max_batch_size": self.collector.max_size,
                             "window_ms": self.collector.window_s * 1000.0},
                "stats": {"busy": round(self.busy.fraction(), 4), "busy_window_s": self.busy.window_s,
                          "nvml_utilisation": self._nvml(),
                          "device_seconds_total": round(self.busy.total_s, 4),
                          "batches_total": self.recent.batches_total, "frames_total": self.recent.frames_total,
                          **self.recent.summary()}}
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.worker_id), json.dumps(info), px=int(ttl * 1000))
        pipe.zadd(self.keys.gpu_workers, {self.worker_id: time.time()})
        pipe.execute()

    def _nvml(self) -> float | None:
        device = self.model.device
        return nvml_utilisation(device.index or 0) if device.type == "cuda" else None

    def _leave(self) -> None:
        try:
            self.redis.delete(self.keys.heartbeat(self.worker_id))
            self.redis.zrem(self.keys.gpu_workers, self.worker_id)
        except redis.RedisError:
            pass
        log.info("gpu worker %s stopped after %d batches", self.worker_id, self.batch_seq)


def _frame_age(raw: bytes) -> float:
    """Seconds a frame waited in the list; unreadable frames count as fresh."""
    try:
        return max(0.0, time.time() - unpack_frame(raw).header.enqueued_at)
    except FrameError:
        return 0.0
