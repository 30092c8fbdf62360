"""The collect/stage stages: take a batch from the list, sort its frames, stage the ones to run.

`collect()` runs in the worker's collect thread: it pops a batch (the batching
window, on this process's clock), which is mostly waiting on Redis and the
network. `prepare()` runs in the stage thread, one batch behind: it unpacks
the frames, triages them in one Redis round trip (unreadable frames fail,
late ones expire, the rest move to `running` unless they have killed workers
too often), then copies the running frames into a staging slot for the device.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from contract.frames import Frame, FrameError, read_job_id, unpack_frame
from contract.frames.frame_source import FrameSource
from contract.jobs import expiry
from contract.jobs.record import EXPIRED, FAILED, MOVED, POISON, RUNNING, JobStatus
from contract.redis.clock import now as service_now
from gpu_worker import metrics
from gpu_worker.batcher import Batch, BatchCollector
from gpu_worker.host_time import HostTime
from gpu_worker.link import WorkerLink
from gpu_worker.model import fits_input
from gpu_worker.staging import Device, DeviceOutput, Staged

log = logging.getLogger("gpu_worker")
Outcome = tuple[str, JobStatus, dict[str, Any]]  # job id, terminal status, fields


@dataclass
class InHand:
    """A batch from the moment it was taken to the moment its results are written.

    `taken` counts every frame popped for it (answered, failed, expired or
    skipped alike): they are acknowledged together once the batch is written,
    and their `taken_bytes` leave the waiting budget then (contract.admission.budget)."""

    seq: int
    taken: int
    closed_by: str
    opened_at: float  # the service's clock (contract.redis.clock): its first frame was popped
    closed_at: float  # the service's clock: the window closed
    running: list[Frame]  # the frames of jobs still wanted, in batch order
    popped_at: list[float]  # the service's clock, per running frame (the batcher's monotonic moments moved onto it)
    staged: Staged | None = None
    output: DeviceOutput | None = None
    started_at: float = 0.0  # the service's clock: its turn on the device began
    give_back: Sequence[memoryview] = ()  # triage could not reach Redis: these frames return to the list
    failed: list[Outcome] = field(default_factory=list)  # triage failed otherwise: these jobs fail
    taken_bytes: int = 0
    epoch: str = ""  # the worker's life it was taken in: written only while that lasts
    # API key id -> its frames among those taken (readable ones): the write counts them out of Keys.key_frames
    owners: dict[str, int] = field(default_factory=dict)


class Feeder:
    def __init__(
        self,
        link: WorkerLink,
        source: FrameSource[memoryview],
        device: Device,
        host_time: HostTime,
        hold_open: Callable[[], bool],
        wait_held: Callable[[float], None] | None = None,
    ) -> None:
        """`hold_open`: whether this model has batches ahead (the gathering batch may keep gathering);
        `wait_held`: wait until they are gone, or the timeout."""
        batching = link.settings.batching
        self.model_labels = (device.spec.name, device.spec.version)
        self.redis = link.redis
        self.store = link.store
        self.source = source
        self.device = device
        self.host_time = host_time
        self.max_attempts = link.settings.gpu_worker.max_attempts
        self.input_size = device.spec.input_size
        self.collector: BatchCollector[memoryview] = BatchCollector(
            batching.max_batch_size,
            batching.window_ms / 1000.0,
            idle_timeout_s=batching.idle_poll_s,
            poll_s=batching.gather_poll_ms / 1000.0,
            age_of=_frame_age,
            hold_open=hold_open,
            held_poll_s=batching.held_poll_ms / 1000.0,
            wait_held=wait_held,
        )
        self.epoch = link.epoch  # the worker's life now (gpu_worker.heartbeat): a batch is written only in its own
        self.next_seq = link.next_seq  # a batch id is worker:seq
        self.pop_s = 0.0  # the last collect's host time (see collect)

    def collect(self) -> tuple[Batch[memoryview], str] | None:
        """The next batch of frames as popped, and the worker's epoch when it began to pop them; None when the
        list stayed empty."""
        epoch = self.epoch()
        with self.host_time("pop"):
            batch = self.collector.collect(self.source)
        # The host's time to take a batch, when it took one whole: its looks only. Its waits for frames (a batch held
        # open behind the device fills as the CPU stage pushes) counted too once, and made a slow device's lane look
        # host-bound: three batches ahead, not one (tests/test_gpu_fairness.py's one-batch-ahead test).
        self.pop_s = self.collector.busy_s if batch is not None and len(batch) >= self.collector.max_size else 0.0
        return (batch, epoch) if batch is not None else None

    def prepare(self, batch: Batch[memoryview], epoch: str = "") -> InHand:
        """The batch triaged, and its running frames staged."""
        seq = self.next_seq()
        offset = service_now() - time.monotonic()
        with self.host_time("unpack"):
            frames, refused, owners = self._unpack(batch)
        with self.host_time("triage"):
            running = self._triage(frames, refused)
        in_hand = InHand(
            seq=seq,
            taken=len(batch),
            closed_by=batch.closed_by,
            opened_at=batch.opened_at + offset,
            closed_at=batch.closed_at + offset,
            running=[frame for frame, _ in running],
            popped_at=[popped + offset for _, popped in running],
            taken_bytes=sum(len(item) for item in batch.items),
            epoch=epoch,
            owners=owners,
        )
        if in_hand.running:
            with self.host_time("stage"):
                in_hand.staged = self.device.stage(in_hand.running)
        return in_hand

    def unprepared(self, batch: Batch[memoryview], exc: Exception, epoch: str = "") -> InHand:
        """A batch whose triage failed, to be written in its turn all the same."""
        in_hand = InHand(
            seq=self.next_seq(),
            taken=len(batch),
            closed_by=batch.closed_by,
            opened_at=service_now(),
            closed_at=service_now(),
            running=[],
            popped_at=[],
            taken_bytes=sum(len(item) for item in batch.items),
            epoch=epoch,
            owners=_owners_of(batch.items),
        )
        if isinstance(exc, redis.RedisError):
            in_hand.give_back = batch.items
        else:
            message = f"the GPU worker could not triage this frame: {type(exc).__name__}"
            in_hand.failed = [
                (job_id, FAILED, {"error": {"code": "internal_error", "message": message}})
                for job_id in map(read_job_id, batch.items)
                if job_id
            ]
        return in_hand

    def _unpack(self, batch: Batch[memoryview]) -> tuple[list[tuple[Frame, float]], list[Outcome], dict[str, int]]:
        """Readable frames that fit the model's input, with their pop times; the rest fail. And the API keys of the
        readable ones, counted."""
        frames, refused, owners = [], [], Counter[str]()
        for raw, popped in zip(batch.items, batch.popped_at):
            try:
                frame = unpack_frame(raw)
                if frame.header.owner:
                    owners[frame.header.owner] += 1
                if not fits_input(frame, self.input_size):
                    raise FrameError(
                        f"content {frame.header.width}x{frame.header.height} at "
                        f"({frame.header.pad_left}, {frame.header.pad_top}) does not fit the "
                        f"model's {self.input_size}x{self.input_size} input"
                    )
            except FrameError as exc:
                job_id = read_job_id(raw)
                log.error("bad frame: %s", exc, extra={"job_id": job_id, "error_code": "bad_frame"})
                if job_id:
                    refused.append((job_id, FAILED, {"error": {"code": "bad_frame", "message": str(exc)}}))
                continue
            frames.append((frame, popped))
        return frames, refused, dict(owners)

    def _triage(self, frames: list[tuple[Frame, float]], refused: list[Outcome]) -> list[tuple[Frame, float]]:
        """One round trip moves the frames' jobs to running (unless poisoned); the unreadable, the
        late and the poisoned cost one more each, only when there are any. (Not one pipeline: redis-py
        checks a pipeline's scripts with an extra round trip of its own.)"""
        now = service_now()
        candidates = []
        for frame, popped in frames:
            if expiry.is_late(frame.header.deadline_at, now):
                refused.append((frame.header.job_id, EXPIRED, expiry.expired_fields(expiry.BEFORE_INFERENCE)))
                metrics.FRAMES_EXPIRED.labels(*self.model_labels).inc()
            else:
                candidates.append((frame, popped))
        if refused:
            self.store.finish_many(refused)
        verdicts = (
            self.store.advance_many([frame.header.job_id for frame, _ in candidates], RUNNING, self.max_attempts)
            if candidates
            else []
        )
        self._fail_poisoned([frame for (frame, _), verdict in zip(candidates, verdicts) if verdict == POISON])
        return [item for item, verdict in zip(candidates, verdicts) if verdict == MOVED]

    def _fail_poisoned(self, frames: list[Frame]) -> None:
        if not frames:
            return
        message = (
            f"the job's frame was in hand each time a GPU worker died ({self.max_attempts} times); not trying again"
        )
        for frame in frames:
            log.error(
                "poison frame: GPU workers died holding it %d times",
                self.max_attempts,
                extra={"job_id": frame.header.job_id, "error_code": "poison"},
            )
        self.store.finish_many(
            [(frame.header.job_id, FAILED, {"error": {"code": "poison", "message": message}}) for frame in frames]
        )


def _owners_of(items: Sequence[memoryview]) -> dict[str, int]:
    """The API keys of the readable frames among `items`, counted."""
    owners = Counter[str]()
    for raw in items:
        try:
            owner = unpack_frame(raw).header.owner
        except FrameError:
            continue
        if owner:
            owners[owner] += 1
    return dict(owners)


def _frame_age(raw: memoryview) -> float:
    """Seconds a frame waited in the list; unreadable frames count as fresh."""
    try:
        return max(0.0, service_now() - unpack_frame(raw).header.pushed_at)
    except FrameError:
        return 0.0
