"""The frame: how a decoded image travels from a CPU worker to a GPU worker, the middle of the pipeline.

4-byte magic, 4-byte big-endian header length, a UTF-8 JSON header, then the letterboxed content as raw uint8
HxWx3 pixels, contiguous. Only the resized content travels; padding and normalisation happen on the device, so a
640 frame is at most 1.2 MB of uint8 instead of 4.9 MB of float32. JSON, not pickle: a frame comes from another
process and must never run code. The header is read here in Python (`unpack_frame`, `read_job_id`) and in Lua
(contract/library/frames.lua's `frame_job_id`, for the steps that move frames).

The frame list's moves: in, contract.frames.frame_push (a CPU worker's push); out, contract.frames.frame_source (a GPU
worker's pops, its ack, give back and requeue); with bulk shards, contract.frames.frame_shards and
contract.frames.frame_shard_source.

The push is the CPU workers' alone and the pops the GPU worker's, yet both live here: each is the Python side of
a library step (library/push.lua, frames.lua) whose argument positions stay beside the other steps', and the two
ends of one list must agree on the frame and the keys it lies under.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

from contract.jobs.timebill import PUSHED_AT
from contract.runtime.release import RELEASE

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
    The CPU worker computes it (tasks.decoding.imaging.letterbox), the frame header carries its fields flat, and
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
    deadline_at: float  # the service's clock; past it nobody waits for the answer
    options: dict[str, Any] = field(default_factory=dict)  # conf, iou, max_det
    stamps: dict[str, float] = field(default_factory=dict)  # time-bill stamps so far, `pushed_at` the last
    dtype: str = "uint8"
    # the job's API key id ("" without keys): the batch write counts its frame out of the key's (Keys.key_frames)
    owner: str = ""

    @property
    def pushed_at(self) -> float:
        """When the frame was pushed (the service's clock): the time bill's own stamp, which the header's
        `enqueued_at` repeated (a frame of an earlier version still carries it: read as this stamp)."""
        return float(self.stamps.get(PUSHED_AT, 0.0))


@dataclass(frozen=True)
class Frame:
    header: FrameHeader
    pixels: memoryview  # height * width * 3 bytes, a view into the popped value


def pack_frame(header: FrameHeader, pixels: bytes) -> bytes:
    expected = header.width * header.height * CHANNELS
    if len(pixels) != expected:
        raise FrameError(f"pixels hold {len(pixels)} bytes, header says {expected}")
    # vars(), not asdict(): the same JSON (fields in order, the two dicts as they are) without asdict's deep
    # copy, paid by every frame (docs/benchmarks/2026-12-05-peer.md). `enqueued_at` is still written,
    # for GPU workers of a release before 0.2.0 (they require it: docs/upgrading.md), and `release` says whose
    # frame it is (a reader that cannot read it names both releases).
    fields = {**vars(header), "enqueued_at": header.pushed_at, "release": RELEASE}
    encoded = json.dumps(fields, separators=(",", ":")).encode()
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


_HEADER_FIELDS = frozenset(FrameHeader.__dataclass_fields__)


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
    except ValueError as exc:
        raise FrameError(f"bad frame header: {exc}") from exc
    if not isinstance(raw, dict):
        raise FrameError("bad frame header: not an object")
    writer = raw.pop("release", None)
    pushed_at = raw.pop("enqueued_at", None)  # a frame of a release before 0.2.0: the stamp under its old name
    if pushed_at is not None and isinstance(raw.get("stamps"), dict):
        raw["stamps"].setdefault(PUSHED_AT, pushed_at)
    try:
        # a field a later release added is dropped (docs/upgrading.md: a header may grow; readers ignore what they
        # do not know); one this release needs and the writer left out is an error that names both releases
        header = FrameHeader(**{name: value for name, value in raw.items() if name in _HEADER_FIELDS})
    except TypeError as exc:
        raise FrameError(
            f"bad frame header (written by {writer or 'an unknown release'}, read by {RELEASE}): {exc}"
        ) from exc
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
