"""The frame list, in: a CPU worker's push of its job's frame (contract.frames is the frame itself).

Each model has its own list, `Keys.frames(model)`, bounded by `max_frames` (a full list makes the CPU workers
wait: the backpressure). `FramePusher.push` moves the job to `queued_gpu` and drops its upload in the same step,
or pushes nothing. With bulk shards (contract.redis.shards) the push is contract.frames.frame_shards'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from contract.jobs.record import QUEUED_GPU, flatten_fields
from contract.library import Step, is_missing
from contract.redis.clock import now as service_now
from contract.redis.keys import UPLOAD_SUFFIX, Keys

PUSHED, LIST_FULL, JOB_OVER = 1, 0, -1  # what a push did
# A model's count of each key's jobs claimed, waiting or in flight (Keys.key_frames: the claim counts a job in,
# contract.jobs.handoff) lives this long after a key's first job in it was last claimed: drift that a lost frame
# leaves (a bulk shard that lost its data, a GPU worker of a release that does not count frames out) is gone once
# the model has been idle this long. Longer than a frame waits (its deadline: 60 s by default). Should it lapse
# under a steady flood, the flood's counts start again from its next jobs: a few of them go to the head until the
# jobs counted before are answered (a count at 0 or below is deleted).
KEY_FRAMES_TTL_S = 300

# A CPU worker's frame goes in as a plain LPUSH (the tail: taken last), or RPUSH (the head: taken next) when its API
# key had fewer than `backpressure.head_frames_per_key` jobs of the model claimed, waiting or in flight before it
# (the claim counted it: contract.jobs.handoff): a light key waits for the device, not behind a flooding key's
# list, while two flooding keys stay first come, first served between themselves. A frame at the head passes the
# list's bound (a key has few there: the bound holds the others), so that a light key never waits for room behind
# a flood.
# The library's `keep_pushed_frame` (contract/library/push.lua, where its keys and arguments are named), in the same
# MULTI, keeps the frame only if it may be there. The frame stays out of Lua: a step that takes a frame as an
# argument makes Redis copy it into Lua and back out, three times this one's CPU
# (docs/benchmarks/2026-12-02-stack-cpu-by-role.md). A claim the job no longer carries (a later delivery of its task
# claimed it after this worker was presumed dead: tasks.hop.recovery) pushes nothing either: one frame per job, whoever
# decoded it.
_KEEP_PUSHED_FRAME = Step("keep_pushed_frame")


class FramePusher:
    """The CPU workers' end of the frame lists, in one Redis (with bulk shards: contract.frames.frame_shards)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self.job_prefix = keys.job_prefix

    def push(
        self,
        job_id: str,
        model_key: str,
        frame: bytes,
        max_frames: int,
        fields: Mapping[str, Any],
        claim: str = "",
        head: bool = False,
    ) -> int:
        """Push a job's frame only if the list has room (a `head` frame, taken next, passes the bound) and the job
        still carries this `claim`, marking it queued_gpu (with `fields`: its stamps) and dropping its upload in the
        same step: PUSHED, LIST_FULL (try again later) or JOB_OVER (over, past preprocessing, or claimed since by
        another delivery of its task)."""
        frames, job_key = self.keys.frames(model_key), self.job_prefix + job_id  # the job's keys named here
        arguments: list[Any] = [
            job_key,
            frames,
            job_key + UPLOAD_SUFFIX,
            self.keys.waiting_bytes,
            max_frames,
            claim,
            len(frame),
            "1" if head else "",
            *flatten_fields({"status": QUEUED_GPU, "updated_at": service_now(), **fields}),
        ]
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=True)
            if head:
                pipe.rpush(frames, frame)
            else:
                pipe.lpush(frames, frame)
            _KEEP_PUSHED_FRAME(pipe, arguments[:4], arguments[4:])
            kept = pipe.execute(raise_on_error=False)[1]
            if not is_missing(kept) or attempt:
                break
            # A Redis without the library (it came back empty) answered inside the transaction, after the push:
            # the frame is taken out again, the library loaded, and the push made once more.
            self.redis.lrem(frames, 1, frame)  # type: ignore[arg-type]  # redis-py's stubs say str; bytes go
            _KEEP_PUSHED_FRAME.recover(self.redis)
        if isinstance(kept, Exception):
            raise kept
        return int(kept)

    def has_room(self, job_id: str, model_key: str, max_frames: int) -> bool:
        """A cheap look before sending `job_id`'s frame again to a list that was full (one list here; over bulk
        shards, the job's shard's: contract.frames.frame_shards)."""
        return int(self.redis.llen(self.keys.frames(model_key))) < max_frames
