"""The frame list, in: a CPU worker's push of its job's frame (contract.frames is the frame itself).

Each model has its own list, `Keys.frames(model)`, bounded by `max_frames` (a full list makes the CPU workers
wait: the backpressure). `FramePusher.push` moves the job to `queued_gpu` and drops its upload in the same step,
or pushes nothing. With bulk shards (contract.shards) the push is contract.frame_shards'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from contract.budget import RELEASE_LUA
from contract.clock import now as service_now
from contract.jobs.record import PREPROCESSING, QUEUED_GPU, TERMINAL_LUA, flatten_fields
from contract.keys import Keys

PUSHED, LIST_FULL, JOB_OVER = 1, 0, -1  # what a push did
# A model's count of each key's frames (Keys.key_frames) lives this long after a key's first frame in it was last
# pushed: drift that a lost frame leaves (a bulk shard that lost its data, a GPU worker of a release that does not
# count frames out) is gone once the model has been idle this long. Longer than a frame waits (its deadline: 60 s
# by default). Should it lapse under a steady flood, the flood's counts start again from its next frames: a few
# of them go to the head until the frames counted before are answered (a count at 0 or below is deleted).
KEY_FRAMES_TTL_S = 300

# What a push (here, and on a bulk shard: contract.frame_shards) checks and does, in the same commands either way.
# live_job: the job's status, model, upload's bytes, claim and API key (its owner), in one HMGET; a job gone or
# ended loses its upload (its bytes given back) and nil says the frame may not stand. release_upload: the upload
# goes, its bytes given back (the model's and its key's). trade_upload_for_frame, once the step's DEL took the upload
# (a DEL that finds none says the job is not this attempt's to push: no EXISTS first): the frame's bytes wait in
# Redis instead of the upload's, until the GPU worker's batch write gives them back (contract.budget): one HINCRBY a
# counter for the difference, with the result a release then a charge would give (the release stops at zero: the
# count is at least the frame's bytes). A key's bytes are its uploads alone: its upload's leave its count here.
# count_key_frame: the frame counted among its key's (Keys.key_frames: '' when not counted), until the batch write
# that ends it counts it out (gpu_worker.finish); the count's TTL renewed when a key's first frame comes (not at
# every push: a flood's pushes would pay an EXPIRE each).
PUSH_LUA = (
    TERMINAL_LUA
    + RELEASE_LUA
    + f"""
local function count_key_frame(counts, owner)
  if counts ~= '' and owner and owner ~= '' and redis.call('HINCRBY', counts, owner, 1) == 1 then
    redis.call('EXPIRE', counts, {KEY_FRAMES_TTL_S})
  end
end
"""
    + """
local function release_upload(upload, waiting, model, upload_bytes, owner)
  if redis.call('DEL', upload) == 1 then release_waiting(waiting, model, upload_bytes, owner) end
end

local function live_job(job, upload, waiting)
  local was = redis.call('HMGET', job, 'status', 'model', 'bytes', 'claim', 'owner')
  local status, model, upload_bytes, owner = was[1], was[2], was[3], was[5]
  if not status or TERMINAL[status] then
    release_upload(upload, waiting, model, upload_bytes, owner)
    return nil
  end
  return status, model, upload_bytes, was[4], owner
end

local function trade_upload_for_frame(waiting, model, upload_bytes, frame_bytes, owner)
  local change = frame_bytes - math.max(0, tonumber(upload_bytes) or 0)
  if model and model ~= '' and redis.call('HINCRBY', waiting, model, change) < frame_bytes then
    redis.call('HSET', waiting, model, frame_bytes)
  end
  if model and owner and owner ~= '' then
    release_field(key_waiting(waiting, owner), model, math.max(0, tonumber(upload_bytes) or 0))
  end
end
"""
)

# A CPU worker's frame goes in as a plain LPUSH (the tail: taken last), or RPUSH (the head: taken next) when its API
# key has fewer than `backpressure.head_frames_per_key` frames of the model waiting or in flight (the claim read
# the count: contract.jobs.handoff): a light key waits for the device, not behind a flooding key's list, while two
# flooding keys stay first come, first served between themselves. A frame at the head passes the list's bound (a
# key has few there: the bound holds the others), so that a light key never waits for room behind a flood.
# This step, in the same MULTI, keeps the frame only if it may be there: the job is still in `preprocessing` with
# its upload (a redelivered task racing the first delivery finds the job past this stage, its upload gone) and a
# tail frame's list is within its bound. Otherwise it drops the frame again (LTRIM at its end: nothing in a
# transaction runs between the two, so that end's frame is this one) and says why. The frame stays out of Lua: a
# script that takes a 0.7 MB frame as an argument makes Redis copy it into Lua and back out, 1.2 ms of Redis's CPU
# against 0.4 for this (measured, one frame at a time).
# A claim the job no longer carries (a later delivery of its task claimed it after this worker was presumed
# dead: tasks.liveness) pushes nothing either: one frame per job, whoever decoded it.
# The upload's bytes leave the waiting budget and the frame's enter it (contract.budget).
# KEYS[1] job hash, KEYS[2] frame list, KEYS[3] upload, KEYS[4] waiting bytes, KEYS[5] the key's frames
# (Keys.key_frames; '' : not counted); ARGV[1] max frames, ARGV[2] the claim, ARGV[3] the frame's length, ARGV[4]
# '1' when the frame went to the head, ARGV[5..] field, value, ... Returns PUSHED, LIST_FULL (nothing changed) or
# JOB_OVER (gone, over or claimed by another: nothing pushed).
_KEEP_PUSHED_FRAME = (
    PUSH_LUA
    + f"""
local head = ARGV[4] == '1'
local function take_back()
  if head then redis.call('LTRIM', KEYS[2], 0, -2) else redis.call('LTRIM', KEYS[2], 1, -1) end
end
local status, model, upload_bytes, claim, owner = live_job(KEYS[1], KEYS[3], KEYS[4])
if not status or status ~= '{PREPROCESSING}' or (claim and claim ~= ARGV[2]) then
  take_back()
  return {JOB_OVER}
end
if not head and redis.call('LLEN', KEYS[2]) > tonumber(ARGV[1]) then
  take_back()
  return {LIST_FULL}
end
if redis.call('DEL', KEYS[3]) == 0 then   -- its upload gone: a redelivered task's race, or a lost shard
  take_back()
  return {JOB_OVER}
end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
trade_upload_for_frame(KEYS[4], model, upload_bytes, tonumber(ARGV[3]), owner)
count_key_frame(KEYS[5], owner)
return {PUSHED}
"""
)


class FramePusher:
    """The CPU workers' end of the frame lists, in one Redis (with bulk shards: contract.frame_shards)."""

    def __init__(self, client: redis.Redis, keys: Keys, count_key_frames: bool = False) -> None:
        """`count_key_frames`: each frame is counted among its key's (backpressure.head_frames_per_key above 0)."""
        self.redis = client
        self.keys = keys
        self.count_key_frames = count_key_frames
        self._keep = client.register_script(_KEEP_PUSHED_FRAME)
        # Loaded before this process's first push, and again after a lost connection (a restarted Redis has
        # forgotten it): a push that meets NOSCRIPT has already pushed its frame, and a GPU worker may take that
        # frame before it is taken back, so that the push made again runs the job twice in one batch (seen on a
        # fresh Redis's first job: a wasted slot, the first answer kept).
        self._loaded = False

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
        frames = self.keys.frames(model_key)
        arguments: list[Any] = [
            self.keys.job(job_id),
            frames,
            self.keys.upload(job_id),
            self.keys.waiting_bytes,
            self.keys.key_frames(model_key) if self.count_key_frames else "",
            max_frames,
            claim,
            len(frame),
            "1" if head else "",
            *flatten_fields({"status": QUEUED_GPU, "updated_at": service_now(), **fields}),
        ]
        if not self._loaded:
            self.redis.script_load(_KEEP_PUSHED_FRAME)
            self._loaded = True
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=True)
            if head:
                pipe.rpush(frames, frame)
            else:
                pipe.lpush(frames, frame)
            # EVALSHA, not EVAL: EVAL sends the step's 1.8 KB and Redis hashes it at every call (98,600 instructions
            # against 52,500). A Redis that forgot the step (a restart) answers NOSCRIPT inside the transaction, after
            # the LPUSH: the frame is taken out again, the step loaded, and the push made once more. (A GPU worker
            # that pops the frame in between answers the job: the second push then finds it over.)
            pipe.evalsha(self._keep.sha, 5, *arguments)
            try:
                kept = pipe.execute(raise_on_error=False)[1]
            except redis.ConnectionError:
                self._loaded = False  # the server may have restarted: load the step again before the next push
                raise
            if not isinstance(kept, redis.exceptions.NoScriptError) or attempt:
                break
            self.redis.lrem(frames, 1, frame)  # type: ignore[arg-type]  # redis-py's stubs say str; bytes go
            self.redis.script_load(_KEEP_PUSHED_FRAME)
        if isinstance(kept, Exception):
            raise kept
        return int(kept)

    def has_room(self, job_id: str, model_key: str, max_frames: int) -> bool:
        """A cheap look before sending `job_id`'s frame again to a list that was full (one list here; over bulk
        shards, the job's shard's: contract.frame_shards)."""
        return int(self.redis.llen(self.keys.frames(model_key))) < max_frames
