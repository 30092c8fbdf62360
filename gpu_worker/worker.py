"""The GPU worker: one process per device, draining the frame list in batches.

Loop: collect a batch (<= max frames, <= window), mark its jobs running
(dropping cancelled and expired ones), assemble one tensor on the device, run
the model, post-process the whole batch at once, then write every result and
acknowledge the frames in a single Redis transaction.
"""
from __future__ import annotations

import json
import logging
import os
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
from gpu_worker.inference import BatchRunner
from gpu_worker.model import LoadedModel
from gpu_worker.source import RedisFrameSource
from gpu_worker.stats import BusyMeter, RecentStats

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
    index: int


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
            age_of=_frame_age)
        self.busy = BusyMeter(settings.gpu_worker.busy_window_s)
        self.runner = BatchRunner(model, settings.gpu_worker.max_candidates, self.busy)
        self.recent = RecentStats()
        self.stopping = threading.Event()
        self.batch_seq = 0
        self.started_at = time.time()
        self.last_progress = time.monotonic()

    # --- lifecycle -------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        self.requeue_own_frames()
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        log.info("gpu worker %s serving %s on %s", self.worker_id, self.model.spec.name, self.model.device)
        try:
            while not self.stopping.is_set():
                self.run_once()
        finally:
            self._leave()

    def run_once(self) -> Batch[bytes] | None:
        """Collect and answer one batch; Redis outages are waited out, not fatal."""
        try:
            batch = self.collector.collect(self.source)
            self.last_progress = time.monotonic()
            if batch is not None:
                self.process(batch)
            return batch
        except redis.RedisError as exc:
            log.warning("redis unavailable (%s); retrying", exc)
            self.stopping.wait(1.0)
            return None

    def requeue_own_frames(self) -> int:
        """Frames a previous life of this worker took but never answered go back first in line."""
        moved = 0
        while self.redis.lmove(self.keys.processing(self.worker_id), self.keys.frames, "LEFT", "RIGHT"):
            moved += 1
        if moved:
            log.warning("requeued %d frames left by a previous run of %s", moved, self.worker_id)
        return moved

    # --- one batch -------------------------------------------------------
    def process(self, batch: Batch[bytes]) -> None:
        self.batch_seq += 1
        offset = time.time() - time.monotonic()
        closed_at = batch.closed_at + offset
        pipe = self.redis.pipeline(transaction=False)
        candidates = self._triage(batch, offset, pipe)
        replies = pipe.execute()
        started = replies[len(replies) - len(candidates):]
        running = [item for item, ok in zip(candidates, started) if ok]
        results = self._infer(running) if running else {}
        pipe = self.redis.pipeline(transaction=True)
        for item in running:
            outcome = results[item.frame.header.job_id]
            self._finish(item, outcome, batch, closed_at, len(running), pipe)
        self.source.ack(len(batch.items), client=pipe)
        self.recent.record_batch(len(batch.items))
        pipe.hset(self.keys.gpu_counters(self.worker_id), mapping=self._counters())
        pipe.execute()
        metrics.observe_batch(len(batch.items), len(running), batch.closed_at - batch.opened_at)
        metrics.GPU_BUSY.set(self.busy.fraction())

    def _triage(self, batch: Batch[bytes], offset: float, pipe: Any) -> list[InFlight]:
        """Unpack frames; fail the unreadable, expire the late, mark the rest running."""
        now = time.time()
        candidates: list[InFlight] = []
        for raw, popped in zip(batch.items, batch.popped_at):
            try:
                frame = unpack_frame(raw)
            except FrameError as exc:
                job_id = read_job_id(raw)
                log.error("bad frame job_id=%s: %s", job_id, exc)
                if job_id:
                    self.store.fail(job_id, "bad_frame", str(exc), client=pipe)
                continue
            if now > frame.header.deadline_at:
                self.store.finish(frame.header.job_id, jobs.EXPIRED,
                                  {"error": {"code": "deadline", "message": "expired before inference"}},
                                  client=pipe)
                metrics.FRAMES_EXPIRED.inc()
                continue
            candidates.append(InFlight(frame=frame, popped_at=popped + offset, index=len(candidates)))
        for item in candidates:
            self.store.advance(item.frame.header.job_id, jobs.RUNNING, client=pipe)
        return candidates

    def _infer(self, items: Sequence[InFlight]) -> dict[str, dict[str, Any]]:
        """job id -> {"result": ..., "infer_ms", "postprocess_ms"} or {"error": ...}.

        A batch that raises is retried one frame at a time, so one poison
        frame fails alone and its batch-mates still get answers.
        """
        try:
            return self._infer_batch(items)
        except Exception as exc:  # the model may raise anything
            if len(items) == 1:
                job_id = items[0].frame.header.job_id
                log.exception("inference failed job_id=%s", job_id)
                return {job_id: {"error": {"code": "inference_error", "message": str(exc)[:500]}}}
            log.warning("batch of %d failed (%s); retrying frames one by one", len(items), exc)
            outcomes: dict[str, dict[str, Any]] = {}
            for item in items:
                outcomes.update(self._infer([item]))
            return outcomes

    def _infer_batch(self, items: Sequence[InFlight]) -> dict[str, dict[str, Any]]:
        frames = [item.frame for item in items]
        run = self.runner.run(frames)
        metrics.DEVICE_SECONDS.inc(run.device_s)
        return {frame.header.job_id: {"result": doc, "infer_ms": run.infer_ms, "postprocess_ms": run.postprocess_ms}
                for frame, doc in zip(frames, run.documents)}

    def _finish(self, item: InFlight, outcome: dict[str, Any], batch: Batch[bytes], closed_at: float,
                size: int, pipe: Any) -> None:
        header = item.frame.header
        finished_at = time.time()
        stamps = {**header.stamps, "popped_at": item.popped_at, "batch_closed_at": closed_at,
                  "finished_at": finished_at}
        stamps.update({k: outcome[k] for k in ("infer_ms", "postprocess_ms") if k in outcome})
        bill = compute_time_bill(stamps)
        self.recent.record_bill(bill)
        fields = {
            "timings": bill,
            "batch": {"id": f"{self.worker_id}:{self.batch_seq}", "seq": self.batch_seq, "size": size,
                      "index": item.index, "closed_by": batch.closed_by, "worker": self.worker_id},
        }
        if "error" in outcome:
            self.store.finish(header.job_id, jobs.FAILED, {**fields, "error": outcome["error"]}, client=pipe)
        else:
            self.store.finish(header.job_id, jobs.SUCCEEDED, {**fields, "result": outcome["result"]},
                              client=pipe)

    def _counters(self) -> dict[str, float]:
        return {"device_seconds_total": round(self.busy.total_s, 6), "batches_total": self.recent.batches_total,
                "frames_total": self.recent.frames_total, "updated_at": time.time()}

    # --- liveness --------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = self.settings.gpu_worker.heartbeat_ttl_s / 3.0
        while not self.stopping.is_set():
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self.stopping.wait(interval)

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
                          "device_seconds_total": round(self.busy.total_s, 4),
                          "batches_total": self.recent.batches_total, "frames_total": self.recent.frames_total,
                          **self.recent.summary()}}
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.worker_id), json.dumps(info), px=int(ttl * 1000))
        pipe.zadd(self.keys.gpu_workers, {self.worker_id: time.time()})
        pipe.execute()

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
