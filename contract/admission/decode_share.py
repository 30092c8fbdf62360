"""What decoding an upload will cost a CPU worker, judged from its header before it is queued, and how much of that
one API key may have in flight at once.

Fairness between keys was per task: each key's jobs wait on queues of their own and the CPU workers take from
them in turn, so another key's photo waited for at most one task of each busy queue, however long that task
was. A key that kept a few at-cap PNGs in flight (each seconds of CPU, against a photo's milliseconds) held
every child of the pool, and another key's photos waited for tens of seconds
(docs/benchmarks/2026-12-06-fairness-by-cost.md).

So an upload's decode is weighed before it is queued, from its header (`decode_cost`): pixels x bytes a pixel
as the file stores it (channels x bytes a sample: a 16-bit sample is two) x INTERLACE_FACTOR for an Adam7 PNG.
An upload of CHARGED_FROM or more is charged to its key (`DecodeShare.take`, one step in Redis) until its CPU
stage ends (`release`: the CPU worker, whatever the outcome); a key whose charged decodes in flight already
hold some of `auth.max_decode_bytes_in_flight` and would pass it with this one is refused (429, Retry-After).
A key with nothing charged in flight is always admitted, so an image of any cost still gets decoded, one at
a time. Small images (photos) are never charged: they cost nothing here and nothing in Redis.

The charges live in one hash (`Keys.decode_share`): job id -> "key|bytes|lapse", where lapse is when the
charge lapses by itself (the job's deadline plus the task's time limit: a worker that died holding it, or a
job whose task never ran, frees its key's share then).
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import redis

from contract.library import Step
from contract.redis.keys import Keys

MIB = 1024 * 1024
CHARGED_FROM = 32 * MIB  # estimated decode bytes from which an upload is charged to its key
INTERLACE_FACTOR = 1.5  # an Adam7 PNG's decode against a plain one's of the same pixels (2026-12-06-fairness-by-cost)
# A CPU child's decode rate as a refusal's Retry-After assumes it: the wait for a key's charged decodes to be about
# done, not a promise (a slower machine's clients come back a little early and are refused again).
DECODED_BYTES_PER_S = 256 * MIB
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type: grey, RGB, palette, grey+alpha, RGBA


def decode_cost(data: bytes | bytearray | memoryview) -> int:
    """The bytes decoding `data` works through, from its header; 0 where the header is not one this weighs
    (a JPEG's draft mode and scan limits, and the decoders' other caps, bound those: tasks.decoding.imaging)."""
    head = bytes(data[:29])
    if len(head) < 29 or not head.startswith(_PNG_SIGNATURE) or head[12:16] != b"IHDR":
        return 0
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", head[16:29])
    per_pixel = _PNG_CHANNELS.get(colour, 4) * max(1, depth // 8)
    cost = width * height * per_pixel
    return int(cost * INTERLACE_FACTOR) if interlace else cost


# The library's `take_decode_share` (contract/library/decode_share.lua, where its keys and arguments are named).
_TAKE = Step("take_decode_share")


class Charge(NamedTuple):
    """`DecodeShare.take`'s answer: whether the upload was charged, and what its key holds (with it if so)."""

    taken: bool
    held: int


class DecodeShare:
    """The keys' charged decodes in flight, in one Redis hash (see the module's note)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis, self.keys = client, keys

    def take(self, key: str, job_id: str, cost: int, share: int, now: float, lapse_at: float) -> Charge:
        """Charge `cost` to `key` for `job_id` unless what the key holds already would pass `share` with it."""
        reply: Any = _TAKE(self.redis, [self.keys.decode_share], [key, job_id, cost, share, repr(now), repr(lapse_at)])
        return Charge(bool(int(reply[0])), int(reply[1]))

    def release(self, job_id: str) -> None:
        """The job's CPU stage is over (decoded, failed, skipped, or it ended before): its charge goes."""
        self.redis.hdel(self.keys.decode_share, job_id)

    def held(self) -> dict[str, int]:
        """Bytes charged per key, lapsed charges included (for tests and the bench)."""
        raw: Any = self.redis.hgetall(self.keys.decode_share)
        totals: dict[str, int] = {}
        for value in raw.values():
            key, cost, _ = value.decode().rsplit("|", 2)
            totals[key] = totals.get(key, 0) + int(cost)
        return totals


def retry_after_s(held: int) -> int:
    """Seconds until a key's charged decodes are about done, at DECODED_BYTES_PER_S (at least 1)."""
    return max(1, math.ceil(held / DECODED_BYTES_PER_S))
