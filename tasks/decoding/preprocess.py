"""One job's CPU stage: claim the upload, decode, letterbox, push its frame.

Idempotent: a redelivered task finds its job already past this stage (or over)
and does nothing, because the push, the status change and the upload's
deletion happen in one transaction.
"""

from __future__ import annotations

import logging
import time
import uuid

import redis

from contract.admission.decode_share import DecodeShare
from contract.frames import FrameHeader, frame_push, pack_frame
from contract.frames.frame_shards import frame_pusher
from contract.jobs import expiry
from contract.jobs.handoff import JobHandOff
from contract.jobs.record import JobRecord
from contract.jobs.timebill import (
    BACKPRESSURE_MS,
    CPU_STARTED_AT,
    DECODE_MS,
    PUSH_STAMPS,
    PUSHED_AT,
    RECEIVED_AT,
    RESIZE_MS,
    SUBMITTED_AT,
)
from contract.redis.clock import CLOCK
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys
from contract.redis.shards import ShardUnavailable, bulk_plane
from contract.settings import Settings
from contract.settings.models import Catalogue, ModelSpec
from tasks.decoding import outcomes
from tasks.decoding.imaging import ImageDecodeError, Letterboxed, decode_image, letterbox
from tasks.decoding.outcomes import StageOutcome
from tasks.decoding.structure import StructureLimits

log = logging.getLogger(__name__)


class Preprocessor:
    """Everything a CPU worker child needs, opened once per child."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.keys = Keys(settings.namespace)
        bulk = bulk_plane(settings, client)
        # a light key's frames go to the head of the list (contract.frames.frame_push): each job counted by key
        self.head_frames = settings.backpressure.head_frames_per_key
        counted = self.head_frames > 0
        self.store = JobHandOff(client, self.keys, settings.jobs.ttl_s, bulk=bulk, count_key_frames=counted)
        self.frames = frame_pusher(client, self.keys, bulk)
        self.catalogue = Catalogue(settings)
        self.decode_share = DecodeShare(client, self.keys)
        decode = settings.decode
        self.structure = StructureLimits(
            decode.max_blocks,
            decode.max_comment_blocks,
            decode.max_exif_bytes,
            decode.max_exif_tags,
            decode.max_rle_commands,
        )

    def run(self, job_id: str) -> StageOutcome:
        """Returns what happened, for the task's log line and Flower. The job store away (a failover to another
        primary, a restart) is waited out here, for most of the task's time limit: a task that failed instead
        would be acked and its job left in `preprocessing` until its deadline."""
        CLOCK.sync_if_due()  # a child's copy of its worker's clock: measured again every SYNC_EVERY_S
        started_at = service_now()
        give_up_at = time.monotonic() + self.settings.celery.task_time_limit_s * STORE_RETRY_SHARE
        backoff = STORE_RETRY_FIRST_S
        while True:
            claim = uuid.uuid4().hex  # this attempt's: a later delivery that claims the job again voids it
            try:
                return self._run(job_id, started_at, claim)
            except ShardUnavailable as exc:  # its bytes are out of reach: it fails now, the other shards' go on
                log.warning("%s: %s", exc, exc.cause, extra={"job_id": job_id})
                return self._failed(job_id, "shard_unavailable", str(exc))
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() + backoff > give_up_at:
                    raise
                log.warning(
                    "job store unavailable (%s); trying the job again in %.1f s", exc, backoff, extra={"job_id": job_id}
                )
                time.sleep(backoff)
                backoff = min(backoff * 2, STORE_RETRY_MAX_S)

    def _run(self, job_id: str, started_at: float, claim: str) -> StageOutcome:
        verdict, upload, record, key_frames = self.store.claim_for_preprocessing(job_id, started_at, claim)
        head = 0 <= key_frames < self.head_frames  # its key has few frames waiting or in flight: taken next
        try:
            return self._claimed(job_id, started_at, claim, verdict, upload, record, head)
        finally:
            if record and record.get("decode_cost"):  # its key's expensive decode is over, however it ended
                self.decode_share.release(job_id)

    def _claimed(
        self,
        job_id: str,
        started_at: float,
        claim: str,
        verdict: str,
        upload: bytes | memoryview | None,
        record: JobRecord,
        head: bool = False,
    ) -> StageOutcome:
        if verdict == "missing":
            return outcomes.MISSING
        if verdict == "over":
            return outcomes.skipped(str(record.get("status")))
        if verdict == "late":
            self.store.expire_late(job_id)  # and its upload dropped
            return outcomes.EXPIRED
        if upload is None:
            return self._failed(job_id, "upload_missing", "the upload expired before a CPU worker reached it")
        spec = self.catalogue.get(record.get("model", ""))
        if spec is None:
            return self._failed(
                job_id,
                "unknown_model",
                f"model {record.get('model')!r} is not configured on this "
                "CPU worker (its config differs from the API's)",
            )
        return self._push_frame(job_id, record, upload, started_at, spec, claim, head)

    def _failed(self, job_id: str, code: str, message: str) -> StageOutcome:
        """The job ends failed with its code; the outcome names the code too, so the task's log line does."""
        self.store.fail(job_id, code, message)
        return outcomes.failed(code)

    def _push_frame(
        self,
        job_id: str,
        record: JobRecord,
        upload: bytes | memoryview,
        started_at: float,
        spec: ModelSpec,
        claim: str,
        head: bool = False,
    ) -> StageOutcome:
        try:
            t0 = time.perf_counter()
            limits = self.settings.decode
            image, orig_size = decode_image(
                upload,
                spec.input_size,
                limits.max_image_pixels,
                limits.max_decoded_bytes,
                limits.max_scans,
                limits.max_pixel_scans,
                self.structure,
            )
            t1 = time.perf_counter()
            boxed = letterbox(image, orig_size, spec.input_size)
        except ImageDecodeError as exc:
            return self._failed(job_id, exc.code, str(exc))
        stamps: dict[str, float] = {}
        if RECEIVED_AT in record:
            stamps[RECEIVED_AT] = record[RECEIVED_AT]
        if SUBMITTED_AT in record:
            stamps[SUBMITTED_AT] = record[SUBMITTED_AT]
        stamps[CPU_STARTED_AT] = started_at
        stamps[DECODE_MS] = (t1 - t0) * 1000.0
        stamps[RESIZE_MS] = (time.perf_counter() - t1) * 1000.0
        return self._commit(job_id, record, boxed, stamps, spec, claim, head)

    def _commit(
        self,
        job_id: str,
        record: JobRecord,
        boxed: Letterboxed,
        stamps: dict,
        spec: ModelSpec,
        claim: str,
        head: bool = False,
    ) -> StageOutcome:
        """Push the frame, mark the job and drop the upload, all or nothing; while the frame list is full,
        wait for room (never drop, never grow the model's list past its bound). Each try packs the frame afresh,
        stamped at that moment: a frame that waited for room is billed `backpressure`, not `queue_gpu`,
        and does not reach the GPU worker looking a window late."""
        limit = self.settings.max_frames(spec)
        ready = time.perf_counter()
        while True:
            pushed_at = service_now()
            tried = {**stamps, BACKPRESSURE_MS: (time.perf_counter() - ready) * 1000.0, PUSHED_AT: pushed_at}
            frame = pack_frame(_header(job_id, record, boxed, tried), boxed.pixels)
            try:
                pushed = {name: tried[name] for name in PUSH_STAMPS}  # the header carries them all
                outcome = self.frames.push(job_id, spec.key, frame, limit, pushed, claim, head)
            except redis.exceptions.OutOfMemoryError:
                # Redis at its maxmemory refuses the push: the frame waits here, as for room on a full list.
                if not self._wait_for_memory(job_id, record):
                    return outcomes.EXPIRED
                continue
            if outcome == frame_push.PUSHED:
                return outcomes.PUSHED
            if outcome == frame_push.JOB_OVER:
                return outcomes.skipped("ended or claimed again meanwhile")
            if not self._wait_for_room(job_id, record, spec.key, limit):
                return outcomes.EXPIRED

    def _wait_for_room(self, job_id: str, record: JobRecord, model_key: str, limit: int) -> bool:
        """Until the model's list has room (True) or the job's deadline passes (it ends expired: False),
        looking at the list's length rather than sending the frame again each time."""
        while True:
            if expiry.expire_if_late(self.store, job_id, record["deadline_at"], expiry.WAITING_FOR_ROOM):
                return False
            time.sleep(self.settings.backpressure.room_poll_s)
            if self.frames.has_room(job_id, model_key, limit):
                return True

    def _wait_for_memory(self, job_id: str, record: JobRecord) -> bool:
        """A pause before the push is tried again; False (the job ended expired) once its deadline passed."""
        if expiry.is_late(record["deadline_at"], margin_s=OOM_RETRY_S):  # no time left to try again
            try:
                expiry.expire(self.store, job_id, expiry.WHILE_STORE_FULL)
            except redis.RedisError:
                pass  # the sweeper ends it at its deadline
            return False
        time.sleep(OOM_RETRY_S)
        return True


OOM_RETRY_S = 0.5  # a CPU worker whose push Redis refused for memory tries again after this
# The job store unreachable: tried again after 0.1 s, doubling to 2 s, for at most this share of the task's
# time limit (Sentinel's failover takes a few seconds; a Redis restart as long as it loads).
STORE_RETRY_FIRST_S, STORE_RETRY_MAX_S, STORE_RETRY_SHARE = 0.1, 2.0, 0.75


def _header(job_id: str, record: JobRecord, boxed: Letterboxed, stamps: dict) -> FrameHeader:
    return FrameHeader(
        job_id=job_id,
        **boxed.placement.fields(),
        deadline_at=record["deadline_at"],
        owner=record.get("owner", ""),
        options=record.get("options") or {},
        stamps=stamps,
    )
