"""The frame list: how a decoded image goes from a CPU worker to a GPU worker, the middle of the pipeline.

The frame. 4-byte magic, 4-byte big-endian header length, a UTF-8 JSON header, then the letterboxed content as
raw uint8 HxWx3 pixels, contiguous. Only the resized content travels; padding and normalisation happen on the
device, so a 640 frame is at most 1.2 MB of uint8 instead of 4.9 MB of float32. JSON, not pickle: a frame comes
from another process and must never run code. The header is read here in Python (`unpack_frame`, `read_job_id`)
and in Lua (`FRAME_JOB_ID_LUA`, for the scripts that move frames).

The list. Each model has its own, `Keys.frames(model)`, bounded by `max_frames` (a full list makes the CPU workers
wait: the backpressure). In: a CPU worker's `FramePusher.push`, which moves the job to `queued_gpu` and drops its
upload in the same step, or pushes nothing. Out: a GPU worker's `RedisFrameSource`. Frames move, never vanish:
BLMOVE/LMOVE carry each frame from the list into the worker's processing list, and only its ack removes them
once their results are written; a worker that dies leaves its frames there, and `requeue_frames_of` gives them
back. The processing list is in the order the frames were taken: the newest at the left, the oldest at the right.
The worker answers its batches in the order it took them, so a batch's frames are always the rightmost ones when
it is acked, and the ack drops them by count, without sending them back over the wire. After an error that may
have left the worker unsure what it holds (a Redis call that failed half way), it answers what it has in hand,
then gives back whatever is left in the list (`requeue_frames_of`): the order holds again.

With bulk shards (contract.shards) the same moves are contract.frame_shards': a list per shard.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import redis

from contract.budget import ALL, RELEASE_LUA
from contract.clock import now as service_now
from contract.jobs.record import PREPROCESSING, QUEUED_GPU, TERMINAL_LUA, flatten_fields
from contract.keys import Keys
from contract.replies import PayloadReader

# --- the frame -------------------------------------------------------------------------------------------
MAGIC = b"IMF1"
_PREFIX = struct.Struct(">4sI")
MAX_HEADER_BYTES = 64 * 1024
CHANNELS = 3


class FrameError(ValueError):
    """Bytes that are not a well-formed frame."""


@dataclass(frozen=True)
class Placement:
    """How the letterbox placed an upright original in the model's square input: the one geometry type.
    The CPU worker computes it (tasks.imaging.letterbox), the frame header carries its fields flat, and
    the GPU worker maps boxes back with MAPPING_FIELDS of it (gpu_worker.postprocess.Geometry, per batch)."""

    width: int  # content width after resize (<= input size)
    height: int
    pad_left: int  # where the content sits in the square input
    pad_top: int
    scale_x: float  # content pixels per original pixel
    scale_y: float
    orig_width: int  # the upright original, EXIF orientation applied
    orig_height: int

    def fields(self) -> dict[str, Any]:
        """As FrameHeader's keyword arguments (a plain copy: asdict's deep copy is not needed for numbers)."""
        return dict(vars(self))


PLACEMENT_FIELDS = tuple(Placement.__dataclass_fields__)
# What maps a box in the input back to the original (the content's size is not needed for that).
MAPPING_FIELDS = ("pad_left", "pad_top", "scale_x", "scale_y", "orig_width", "orig_height")


@dataclass(frozen=True)
class FrameHeader:
    job_id: str
    width: int  # the Placement's fields, flat (the wire format): see Placement
    height: int
    pad_left: int
    pad_top: int
    scale_x: float
    scale_y: float
    orig_width: int
    orig_height: int
    enqueued_at: float  # epoch seconds, when the frame was pushed
    deadline_at: float  # epoch seconds; past it nobody waits for the answer
    options: dict[str, Any] = field(default_factory=dict)  # conf, iou, max_det
    stamps: dict[str, float] = field(default_factory=dict)  # time-bill stamps so far
    dtype: str = "uint8"


@dataclass(frozen=True)
class Frame:
    header: FrameHeader
    pixels: memoryview  # height * width * 3 bytes, a view into the popped value


def pack_frame(header: FrameHeader, pixels: bytes) -> bytes:
    expected = header.width * header.height * CHANNELS
    if len(pixels) != expected:
        raise FrameError(f"pixels hold {len(pixels)} bytes, header says {expected}")
    # vars(), not asdict(): the same JSON (fields in order, the two dicts as they are) without asdict's deep
    # copy, a fifth of a millisecond of a CPU child's plumbing per frame (py-spy).
    encoded = json.dumps(vars(header), separators=(",", ":")).encode()
    return b"".join((_PREFIX.pack(MAGIC, len(encoded)), encoded, pixels))


def unpack_frame(data: bytes | memoryview) -> Frame:
    """Parse a frame without copying its pixels; raises FrameError on any defect."""
    header = _read_header(data)
    start = _PREFIX.size + _header_length(data)
    pixels = memoryview(data)[start:]
    expected = header.width * header.height * CHANNELS
    if len(pixels) != expected:
        raise FrameError(f"frame holds {len(pixels)} pixel bytes, header says {expected}")
    return Frame(header=header, pixels=pixels)


def read_job_id(data: bytes | memoryview) -> str | None:
    """The job id of a frame, or None when even the header is unreadable."""
    try:
        return _read_header(data).job_id
    except FrameError:
        return None


# The same read in Lua, for the scripts that move frames without Python (a dead worker's requeue): a frame's job id,
# or nil when its header is unreadable. `struct` and `cjson` are Redis's own Lua libraries.
FRAME_JOB_ID_LUA = f"""
local function frame_job_id(frame)
  local ok, header = pcall(function()
    local length = struct.unpack('>I4', string.sub(frame, {len(MAGIC) + 1}, {_PREFIX.size}))
    return cjson.decode(string.sub(frame, {_PREFIX.size + 1}, {_PREFIX.size} + length))
  end)
  if ok and type(header) == 'table' and type(header.job_id) == 'string' then return header.job_id end
  return nil
end
"""


def _header_length(data: bytes | memoryview) -> int:
    if len(data) < _PREFIX.size:
        raise FrameError("frame shorter than its prefix")
    magic, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FrameError("bad frame magic")
    if length > MAX_HEADER_BYTES or _PREFIX.size + length > len(data):
        raise FrameError("bad frame header length")
    return int(length)


def _read_header(data: bytes | memoryview) -> FrameHeader:
    length = _header_length(data)
    try:
        raw = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + length]))
        header = FrameHeader(**raw)
    except (ValueError, TypeError) as exc:
        raise FrameError(f"bad frame header: {exc}") from exc
    _check_header(header)
    return header


def _check_header(header: FrameHeader) -> None:
    ints = (header.width, header.height, header.pad_left, header.pad_top, header.orig_width, header.orig_height)
    if not all(isinstance(v, int) and v >= 0 for v in ints) or not header.width or not header.height:
        raise FrameError("frame geometry must be positive integers")
    if header.dtype != "uint8":
        raise FrameError(f"frame dtype {header.dtype!r} unsupported")
    if not isinstance(header.job_id, str) or not header.job_id:
        raise FrameError("frame without a job id")


# --- the list: in -------------------------------------------------------------------------------------------
PUSHED, LIST_FULL, JOB_OVER = 1, 0, -1  # what a push did

# What a push (here, and on a bulk shard: contract.frame_shards) checks and does, in the same commands either way.
# live_job: the job's status, model and upload's bytes; a job gone or ended loses its upload (its bytes given
# back) and nil says the frame may not stand. release_upload: the upload goes, its bytes given back (they left
# with the frame). charge_frame: the frame's bytes wait in Redis now, until the GPU worker's batch write gives
# them back (contract.budget).
PUSH_LUA = (
    TERMINAL_LUA
    + RELEASE_LUA
    + f"""
local function release_upload(upload, waiting, model, upload_bytes)
  if redis.call('DEL', upload) == 1 then release_waiting(waiting, model, upload_bytes) end
end

local function live_job(job, upload, waiting)
  local status = redis.call('HGET', job, 'status')
  local model, upload_bytes = redis.call('HGET', job, 'model'), redis.call('HGET', job, 'bytes')
  if not status or TERMINAL[status] then
    release_upload(upload, waiting, model, upload_bytes)
    return nil
  end
  return status, model, upload_bytes
end

local function charge_frame(waiting, model, frame_bytes)
  for _, field in ipairs({{model or '', '{ALL}'}}) do
    if field ~= '' then redis.call('HINCRBY', waiting, field, frame_bytes) end
  end
end
"""
)

# A CPU worker's frame goes in as a plain LPUSH, and this step, in the same MULTI, keeps it only if it may be
# there: the job is still in `preprocessing` with its upload (a redelivered task racing the first delivery
# finds the job past this stage, its upload gone) and the list is within its bound. Otherwise it drops the
# frame again (LTRIM: nothing in a transaction runs between the two, so the leftmost frame is this one) and
# says why. The frame stays out of Lua: a script that takes a 0.7 MB frame as an argument makes Redis copy
# it into Lua and back out, 1.2 ms of Redis's CPU against 0.4 for this (measured, one frame at a time).
# A claim the job no longer carries (a later delivery of its task claimed it after this worker was presumed
# dead: tasks.liveness) pushes nothing either: one frame per job, whoever decoded it.
# The upload's bytes leave the waiting budget and the frame's enter it (contract.budget).
# KEYS[1] job hash, KEYS[2] frame list, KEYS[3] upload, KEYS[4] waiting bytes; ARGV[1] max frames, ARGV[2] the
# claim, ARGV[3] the frame's length, ARGV[4..] field, value, ... Returns PUSHED, LIST_FULL (nothing changed) or
# JOB_OVER (gone, over or claimed by another: nothing pushed).
_KEEP_PUSHED_FRAME = (
    PUSH_LUA
    + f"""
local status, model, upload_bytes = live_job(KEYS[1], KEYS[3], KEYS[4])
if not status then
  redis.call('LTRIM', KEYS[2], 1, -1)
  return {JOB_OVER}
end
local claim = redis.call('HGET', KEYS[1], 'claim')
if status ~= '{PREPROCESSING}' or redis.call('EXISTS', KEYS[3]) == 0 or (claim and claim ~= ARGV[2]) then
  redis.call('LTRIM', KEYS[2], 1, -1)
  return {JOB_OVER}
end
if redis.call('LLEN', KEYS[2]) > tonumber(ARGV[1]) then
  redis.call('LTRIM', KEYS[2], 1, -1)
  return {LIST_FULL}
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
release_upload(KEYS[3], KEYS[4], model, upload_bytes)
charge_frame(KEYS[4], model, tonumber(ARGV[3]))
return {PUSHED}
"""
)


class FramePusher:
    """The CPU workers' end of the frame lists, in one Redis (with bulk shards: contract.frame_shards)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    def push(
        self, job_id: str, model_key: str, frame: bytes, max_frames: int, fields: Mapping[str, Any], claim: str = ""
    ) -> int:
        """Push a job's frame only if the list has room and the job still carries this `claim`, marking it
        queued_gpu (with `fields`: its stamps) and dropping its upload in the same step: PUSHED, LIST_FULL (try
        again later) or JOB_OVER (over, past preprocessing, or claimed since by another delivery of its task)."""
        frames = self.keys.frames(model_key)
        pipe = self.redis.pipeline(transaction=True)
        pipe.lpush(frames, frame)
        # EVAL, not EVALSHA: a script Redis has forgotten would fail inside the transaction after the push.
        pipe.eval(
            _KEEP_PUSHED_FRAME,
            4,
            self.keys.job(job_id),
            frames,
            self.keys.upload(job_id),
            self.keys.waiting_bytes,
            max_frames,
            claim,
            len(frame),
            *flatten_fields({"status": QUEUED_GPU, "updated_at": service_now(), **fields}),
        )
        return int(pipe.execute()[1])

    def has_room(self, model_key: str, max_frames: int, job_id: str = "") -> bool:
        """A cheap look before sending a frame again to a list that was full."""
        return int(self.redis.llen(self.keys.frames(model_key))) < max_frames


# --- the list: out ------------------------------------------------------------------------------------------
Popped = TypeVar("Popped")


class FrameSource(Protocol[Popped]):
    """What a GPU worker's lane takes frames from and answers them to: RedisFrameSource, or ShardedFrameSource
    (contract.frame_shards); the batcher (gpu_worker.batcher) uses the two pops. A frame is a memoryview there;
    generic so that the batcher's tests can pop anything."""

    acked_by_batch_write: bool  # the batch write trims the processing list itself (else `ack` does, after it)

    def pop_blocking(self, timeout_s: float) -> Popped | None: ...
    def pop_available(self, limit: int) -> Sequence[Popped]: ...
    def ack(self, count: int, client: Any = None) -> None: ...
    def give_back(self, frames: Sequence[Popped]) -> None: ...
    def forget(self) -> None: ...


class RedisFrameSource:
    """One model's frame list, and this worker's processing list for it."""

    acked_by_batch_write = True  # the Finisher's one write trims the processing list (ack is for tools)

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, model_key: str) -> None:
        self.redis = client
        self.frames_key = keys.frames(model_key)
        self.processing_key = keys.processing(worker_id, model_key)
        self.reader = PayloadReader(client)  # frames are read straight into one buffer each

    def pop_blocking(self, timeout_s: float) -> memoryview | None:
        # Oldest frame is at the right (producers LPUSH): FIFO.
        return self.reader.bulks(("BLMOVE", self.frames_key, self.processing_key, "RIGHT", "LEFT", timeout_s))[0]

    def pop_available(self, limit: int) -> list[memoryview]:
        """Up to `limit` frames, oldest first, in one round trip. Not a Lua script: a script that
        returns frames makes Redis copy each one into the script and again into the reply (about
        4x the server CPU of LMOVE for a 225 KB frame)."""
        if limit <= 0:
            return []
        move = ("LMOVE", self.frames_key, self.processing_key, "RIGHT", "LEFT")
        return [frame for frame in self.reader.bulks(*[move] * limit) if frame is not None]

    def ack(self, count: int, client: Any = None) -> None:
        """Drop the `count` oldest frames in hand: the batch just answered (see the module's note)."""
        if count > 0:
            (client if client is not None else self.redis).ltrim(self.processing_key, 0, -(count + 1))

    def give_back(self, frames: Sequence[memoryview]) -> None:
        """The oldest frames in hand (these, in order) back to the front of the list, in one step."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(self.frames_key, *reversed(frames))
        pipe.ltrim(self.processing_key, 0, -(len(frames) + 1))
        pipe.execute()

    def forget(self) -> None:
        """Nothing to forget: what is in hand is in the processing list alone."""


# Give a worker's unanswered frames back to their models' lists, oldest first in line, and (when
# ARGV[3] is 1: its worker died holding them) count one more attempt on each job. KEYS[1] the worker's
# heartbeat (if it lives, nothing is touched; '' when the worker gives back its own), KEYS[2] the worker
# registry, KEYS[3] the worker's epoch (deleted when reaping: a worker that was only paused finds it gone and
# writes nothing), then per model its processing list and its frame list; ARGV[1] job key prefix, ARGV[2]
# worker id. Atomic, so two reapers never both requeue.
_REQUEUE = (
    FRAME_JOB_ID_LUA
    + """
if KEYS[1] ~= '' and redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
if KEYS[1] ~= '' then
  redis.call('DEL', KEYS[3])
end
local function count_attempt(frame)
  local job_id = frame_job_id(frame)
  if job_id then
    local job = ARGV[1] .. job_id
    if redis.call('EXISTS', job) == 1 then
      redis.call('HINCRBY', job, 'attempts', 1)
    end
  end
end
local moved = 0
for k = 4, #KEYS, 2 do
  while true do
    local frame = redis.call('LMOVE', KEYS[k], KEYS[k + 1], 'LEFT', 'RIGHT')
    if not frame then break end
    moved = moved + 1
    if ARGV[3] == '1' then
      count_attempt(frame)
    end
  end
end
if KEYS[1] ~= '' then
  redis.call('ZREM', KEYS[2], ARGV[2])
end
return moved
"""
)


def requeue_frames_of(
    client: redis.Redis,
    keys: Keys,
    worker_id: str,
    model_keys: Sequence[str],
    only_if_dead: bool,
    count_attempt: bool = True,
) -> int:
    """Move `worker_id`'s processing lists of these models back to the models' frame lists; -1 if it
    turned out alive. `count_attempt`: the worker died holding them (a step towards `poison`)."""
    script = client.register_script(_REQUEUE)
    heartbeat = keys.heartbeat(worker_id) if only_if_dead else ""
    lists = [key for model_key in model_keys for key in (keys.processing(worker_id, model_key), keys.frames(model_key))]
    return int(
        script(
            keys=[heartbeat, keys.gpu_workers, keys.gpu_epoch(worker_id), *lists],
            args=[keys.job(""), worker_id, "1" if count_attempt else "0"],
        )
    )
