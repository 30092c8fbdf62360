"""The finish stage: a batch's device output becomes result documents, written in one round trip.

In the worker's finish thread, while the device runs the next batch: the
detections come back as Python values, each job gets its result (or the error
its frame failed with alone), its time bill and its batch, and one Redis function (`write_batch`)
ends every job, acknowledges every frame the batch took and updates the
worker's counters, atomically. Results wait in memory until Redis takes them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from contract.cache.cache_plane import cache_plane
from contract.frames import Frame
from contract.frames.frame_source import FrameSource
from contract.jobs.hits import HitLimits, answer_debits, stored_bytes
from contract.jobs.record import FAILED, SUCCEEDED
from contract.jobs.timebill import (
    BATCH_CLOSED_AT,
    DEVICE_STARTED_AT,
    FINISHED_AT,
    INFER_MS,
    POPPED_AT,
    POSTPROCESS_MS,
    compute_time_bill,
)
from contract.library import Step
from contract.redis.clock import now as service_now
from contract.redis.keys import model_frames_total
from contract.settings.models import ModelSpec
from gpu_worker import metrics
from gpu_worker.feeder import InHand, Outcome
from gpu_worker.link import LaneMeters, WorkerLink
from gpu_worker.staging import DeviceOutput

log = logging.getLogger("gpu_worker")

# The batch's one write: the library's `write_batch` (contract/library/write_batch.lua, where its keys and
# arguments are named; `Finisher._write` builds them).
_WRITE_BATCH = Step("write_batch_debited")


def detections_per_image(detections: np.ndarray, count: int) -> list[list[list[float]]]:
    """The batch's detection rows (image, x1, y1, x2, y2, score, class), rounded as served and
    split by image: one conversion to Python values for the whole batch."""
    if not len(detections):
        return [[] for _ in range(count)]
    rounded = detections.copy()
    rounded[:, 1:5] = np.round(detections[:, 1:5], 2)
    rounded[:, 5] = np.round(detections[:, 5], 4)
    bounds = np.searchsorted(detections[:, 0], np.arange(count + 1), side="left").tolist()
    rows = rounded.tolist()
    return [rows[bounds[i] : bounds[i + 1]] for i in range(count)]


def result_documents(detections: np.ndarray, frames: Sequence[Frame], spec: ModelSpec) -> list[dict[str, Any]]:
    """One result document per frame, in order."""
    return documents_from_rows(detections_per_image(detections, len(frames)), frames, spec)


def documents_from_rows(
    per_image: list[list[list[float]]], frames: Sequence[Frame], spec: ModelSpec
) -> list[dict[str, Any]]:
    labels = spec.labels
    model = {"name": spec.name, "version": spec.version}
    documents = []
    for frame, rows in zip(frames, per_image):
        found = [
            {
                "box": row[1:5],
                "score": row[5],
                "class_id": int(row[6]),
                "label": labels[int(row[6])] if int(row[6]) < len(labels) else str(int(row[6])),
            }
            for row in rows
        ]
        documents.append(
            {
                "detections": found,
                "image": {"width": frame.header.orig_width, "height": frame.header.orig_height},
                "model": model,
            }
        )
    return documents


class Finisher:
    def __init__(self, link: WorkerLink, spec: ModelSpec, meters: LaneMeters, source: FrameSource[memoryview]) -> None:
        self.source = source
        self.redis = link.redis
        self.store = link.store
        self.keys = link.keys
        self.worker_id = link.worker_id
        self.spec = spec
        self.host_time = meters.host_time
        self.busy = meters.busy
        self.recent = meters.worker_recent
        self.retry = link.retry
        self.model_recent = meters.recent
        self.model_labels = (spec.name, spec.version)
        # Acked by the batch write itself, or (bulk shards) by the source once the write is done.
        self.acked_key = link.keys.processing(link.worker_id, spec.key) if source.acked_by_batch_write else ""
        self.ttl_s = link.settings.jobs.ttl_s
        # each acknowledged frame counted out of its API key's (the CPU workers count them in:
        # contract.frames.frame_push)
        self.key_frames = link.keys.key_frames(spec.key) if link.settings.backpressure.head_frames_per_key > 0 else ""
        self.cache_plane = cache_plane(link.settings)  # the cache's own Redis, if it has one: entries written after
        # every keyed job's answer taken from its key's answer bucket by the write that stores it (contract.jobs.hits)
        self.answers = HitLimits.of(link.settings)

    def finish(self, batch: InHand) -> None:
        """Documents for every running job of the batch, then the one write (retried until Redis answers)."""
        if batch.give_back:
            self.retry(lambda: self.source.give_back(batch.give_back))
            log.warning("gave back %d frames", batch.taken)
            return
        output = batch.output
        outcomes: list[Outcome] = list(batch.failed)
        if output is not None:
            started = time.perf_counter()
            with self.host_time("readback"):
                per_image = detections_per_image(output.detections, len(batch.running))
            readback_ms = (time.perf_counter() - started) * 1000.0
            with self.host_time("documents"):
                documents = documents_from_rows(per_image, batch.running, self.spec)
                outcomes = self._outcomes(batch, output, documents, readback_ms)
        with self.host_time("write"):
            written = self.retry(lambda: self._write(batch, outcomes))
        self.recent.record_batch(batch.taken)
        if self.model_recent is not None:
            self.model_recent.record_batch(batch.taken)
        metrics.observe_batch(self.model_labels, batch.taken, len(batch.running), batch.closed_at - batch.opened_at)
        if outcomes and written:  # a fenced write answered nothing: its jobs are another worker's now
            log.info(
                "batch answered",
                extra={
                    "batch": f"{self.worker_id}:{batch.seq}",
                    "size": len(batch.running),
                    "job_ids": [job_id for job_id, _, _ in outcomes],
                },
            )

    def fail_all(self, batch: InHand, code: str, message: str) -> None:
        """End every running job of the batch as failed and acknowledge its frames."""
        outcomes = [
            (frame.header.job_id, FAILED, {"error": {"code": code, "message": message}}) for frame in batch.running
        ]
        self.retry(lambda: self._write(batch, outcomes))

    def _outcomes(
        self, batch: InHand, output: DeviceOutput, documents: list[dict[str, Any]], readback_ms: float
    ) -> list[Outcome]:
        finished_at = service_now()
        size, batch_id = len(batch.running), f"{self.worker_id}:{batch.seq}"
        durations = {INFER_MS: output.infer_ms, POSTPROCESS_MS: output.postprocess_ms + readback_ms}
        outcomes: list[Outcome] = []
        for index, (frame, popped_at, document) in enumerate(zip(batch.running, batch.popped_at, documents)):
            bill = compute_time_bill(
                {
                    **frame.header.stamps,
                    POPPED_AT: popped_at,
                    BATCH_CLOSED_AT: max(popped_at, batch.closed_at),
                    DEVICE_STARTED_AT: batch.started_at,
                    FINISHED_AT: finished_at,
                    **durations,
                }
            )
            self.recent.record_bill(bill)
            if self.model_recent is not None:
                self.model_recent.record_bill(bill)
            metrics.observe_bill(self.model_labels, bill)
            fields: dict[str, Any] = {
                "timings": bill,
                "batch": {
                    "id": batch_id,
                    "seq": batch.seq,
                    "size": size,
                    "index": index,
                    "closed_by": batch.closed_by,
                    "worker": self.worker_id,
                },
            }
            error = output.errors.get(index)
            if error is not None:
                outcomes.append((frame.header.job_id, FAILED, {**fields, "error": error}))
            else:
                outcomes.append((frame.header.job_id, SUCCEEDED, {**fields, "result": document}))
        return outcomes

    def _write(self, batch: InHand, outcomes: list[Outcome]) -> bool:
        """The batch's one write; False when the worker's epoch was gone (nothing written)."""
        counters = [value for pair in self._counters(batch.taken).items() for value in pair]
        owners = [value for pair in batch.owners.items() for value in pair] if self.key_frames else []
        job_keys, job_args = self.store.finish_arguments(outcomes)
        debits = self._debits(batch, job_args)
        written = _WRITE_BATCH(
            self.redis,
            [
                self.keys.callback_outbox,
                self.acked_key,
                self.keys.gpu_counters(self.worker_id),
                self.keys.gpu_epoch(self.worker_id),
                self.keys.frames_waiting,
                self.key_frames,
                *job_keys,
            ],
            [
                *self.store.finish_names(),
                batch.taken,
                batch.taken_bytes,
                self.spec.key,
                len(counters),
                batch.epoch,
                len(owners),
                len(debits),
                *counters,
                *owners,
                *debits,
                *job_args,
            ],
        )
        if isinstance(written, list):  # the cache on its own Redis: the entries to store there, after this step
            self._remember(written[1:], job_args)
            written = int(written[0])
        if written == -1:
            log.warning(
                "batch %d not written: this worker was presumed dead and its frames given to others",
                batch.seq,
                extra={"batch": f"{self.worker_id}:{batch.seq}"},
            )
            return False
        if not self.source.acked_by_batch_write:
            self.source.ack(batch.taken)
        return True

    def _debits(self, batch: InHand, job_args: list[Any]) -> list[Any]:
        """write_batch's answer debits: what each API key's jobs of the batch store, from their end's arguments."""
        if self.answers.bucket_bytes <= 0:
            return []
        owner_of = {frame.header.job_id: frame.header.owner for frame in batch.running if frame.header.owner}
        if not owner_of:
            return []
        spent: Counter[str] = Counter()
        at = 0
        while at < len(job_args):  # per job: its id, its count of field and value arguments, those (finish_arguments)
            job_id, count = job_args[at], int(job_args[at + 1])
            owner = owner_of.get(job_id)
            if owner:
                spent[owner] += stored_bytes(job_args[at + 2 : at + 2 + count])
            at += 2 + count
        return answer_debits(self.answers, self.keys, spent, service_now())

    def _remember(self, pairs: list[Any], job_args: list[Any]) -> None:
        """The entries of the jobs write_batch ended `succeeded` in time ((job id, digest) pairs), stored on the cache
        Redis: a second write, outside the control plane's step. Dropped when that Redis is away or slow (the plane
        marks it down), and never written when this worker dies first: either way a later request for the image
        misses and is computed again, and no entry ever holds an answer whose end did not stand."""
        if self.cache_plane is None or not pairs:
            return
        results: dict[str, str] = {}
        at = 0
        while at < len(job_args):  # per job: its id, its count of field and value arguments, those (finish_arguments)
            job_id, count = job_args[at], int(job_args[at + 1])
            flat = job_args[at + 2 : at + 2 + count]
            fields = dict(zip(flat[::2], flat[1::2]))
            if "result" in fields:
                results[job_id] = fields["result"]
            at += 2 + count
        entries = [
            (self.keys.cache_entry(bytes(digest).decode()), results[bytes(job_id).decode()])
            for job_id, digest in zip(pairs[::2], pairs[1::2])
            if bytes(job_id).decode() in results
        ]
        limits = self.store.cache
        if self.cache_plane.remember(entries, limits.ttl_s, limits.max_bytes) is None:
            log.info("%d result-cache entries dropped: the cache Redis is away", len(entries))

    def _counters(self, taken: int) -> dict[str, float]:
        """The model's frames answered, including the batch being written: admission's drain rate reads it
        (app.drain) at up to a reading a second, which a total a heartbeat old (every third of its TTL) would
        show as steps. The worker's other counters are its heartbeat's (gpu_worker.heartbeat: worker_counters),
        not arguments of every batch write."""
        return {model_frames_total(self.spec.key): self.model_recent.frames_total + taken}
