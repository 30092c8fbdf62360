"""The frame lists over bulk shards (contract.shards), in: contract.frame_push's push, a list per shard.

A job's frame lies on its upload's shard. `ShardedFramePusher.push` puts the frame onto the shard within the
shard's share of the bound, then asks the control plane's verdict on the job (the same checks as a push in one
Redis: contract.frame_push's PUSH_LUA); a frame that may not stand is taken back. The way out over the shards is
contract.frame_shard_source.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from contract.clock import now as service_now
from contract.frame_push import JOB_OVER, LIST_FULL, PUSH_LUA, PUSHED, FramePusher
from contract.jobs.record import PREPROCESSING, QUEUED_GPU, RUNNING, flatten_fields
from contract.keys import Keys
from contract.shards import SHARD_ERRORS, BulkPlane, ShardUnavailable

# The frame goes to the job's shard first, kept only within the shard's bound: the push and this step in one
# MULTI, on the shard. A frame pushed to the head (its key's frames are few: contract.frame_push) passes the bound.
# KEYS[1] the frame list; ARGV[1] its bound, ARGV[2] '1' for a head frame. Returns 1 kept, 0 dropped again (the
# list was full).
_KEEP_WITHIN_BOUND = """
if ARGV[2] ~= '1' and redis.call('LLEN', KEYS[1]) > tonumber(ARGV[1]) then
  redis.call('LTRIM', KEYS[1], 1, -1)
  return 0
end
return 1
"""

# ...then this step, on the control plane, says whether the frame may stand: as contract.frame_push'
# _KEEP_PUSHED_FRAME's checks, and a job already `running` with this claim is the frame's own (a GPU worker took
# it before this step ran: the stamps are written, the status and the frame's bytes are left alone, its batch
# write gives them back). The frame is counted among its model's frames on the shards (Keys.frames_waiting; the
# batch write that acknowledges it counts it out, and each GPU worker's heartbeat sets the count to what the
# lists hold), and among its key's (Keys.key_frames), which the same batch write counts out. KEYS[1] job hash,
# KEYS[2] the upload's marker, KEYS[3] waiting bytes, KEYS[4] frames waiting, KEYS[5] the key's frames ('' : not
# counted); ARGV[1] the claim, ARGV[2] the frame's length, ARGV[3..] field, value, ... Returns PUSHED or JOB_OVER
# (the caller takes the frame back).
_MARK_PUSHED = (
    PUSH_LUA
    + f"""
local status, model, upload_bytes, claim, owner = live_job(KEYS[1], KEYS[2], KEYS[3])
if not status then return {JOB_OVER} end
if (claim and claim ~= ARGV[1]) or (status ~= '{PREPROCESSING}' and status ~= '{RUNNING}') then return {JOB_OVER} end
if status == '{RUNNING}' then   -- its frame is in a batch already: the stamps alone
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
  release_upload(KEYS[2], KEYS[3], model, upload_bytes, owner)
  count_key_frame(KEYS[5], owner)
  return {PUSHED}
end
if redis.call('DEL', KEYS[2]) == 0 then return {JOB_OVER} end
redis.call('HSET', KEYS[1], 'status', '{QUEUED_GPU}', unpack(ARGV, 3))
if model then redis.call('HINCRBY', KEYS[4], model, 1) end
trade_upload_for_frame(KEYS[3], model, upload_bytes, tonumber(ARGV[2]), owner)
count_key_frame(KEYS[5], owner)
return {PUSHED}
"""
)


class ShardedFramePusher(FramePusher):
    """The CPU workers' end of the frame lists over bulk shards."""

    def __init__(self, client: redis.Redis, keys: Keys, bulk: BulkPlane, count_key_frames: bool = False) -> None:
        super().__init__(client, keys, count_key_frames)
        self.bulk = bulk
        self._mark_pushed = client.register_script(_MARK_PUSHED)

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
        """FramePusher.push with bulk shards: the frame onto the job's shard within the shard's bound, then the
        control plane's verdict (_MARK_PUSHED); a frame that may not stand is taken back. A worker that dies
        between the two leaves a frame whose job is still `preprocessing`: the task's redelivery pushes
        another, and the first one answered wins (contract.shards' note). ShardUnavailable when the shard does
        not answer."""
        index = self.bulk.index(job_id)
        shard, frames = self.bulk.clients[index], self.keys.frames(model_key)
        try:
            pipe = shard.pipeline(transaction=True)
            if head:
                pipe.rpush(frames, frame)
            else:
                pipe.lpush(frames, frame)
            # EVAL, not EVALSHA: a script the shard has forgotten would fail inside the transaction after the push.
            pipe.eval(_KEEP_WITHIN_BOUND, 1, frames, self.bulk.frame_bound(max_frames), "1" if head else "")
            kept = int(pipe.execute()[1])
        except SHARD_ERRORS as exc:
            self.bulk.mark_down(index)
            raise ShardUnavailable(index, exc) from exc
        if not kept:
            return LIST_FULL
        stamps = flatten_fields({"updated_at": service_now(), **fields})
        outcome = int(
            self._mark_pushed(
                keys=[
                    self.keys.job(job_id),
                    self.keys.upload(job_id),
                    self.keys.waiting_bytes,
                    self.keys.frames_waiting,
                    self.keys.key_frames(model_key) if self.count_key_frames else "",
                ],
                args=[claim, len(frame), *stamps],
            )
        )
        if outcome != PUSHED:
            try:
                shard.lrem(frames, 1, frame)  # type: ignore[arg-type]  # redis-py's stubs say str; bytes go
            except redis.RedisError:
                pass  # a GPU worker that takes it finds its job over (or another frame's) and skips it
        return outcome

    def has_room(self, job_id: str, model_key: str, max_frames: int) -> bool:
        """The job's shard's list, against its share of the bound."""
        return int(self.bulk.client_for(job_id).llen(self.keys.frames(model_key))) < self.bulk.frame_bound(max_frames)


def frame_pusher(
    client: redis.Redis, keys: Keys, bulk: BulkPlane | None = None, count_key_frames: bool = False
) -> FramePusher:
    """The CPU workers' end of the frame lists: over `bulk`'s shards when it has any, else in `client`'s Redis;
    `count_key_frames`: each frame counted among its key's (Keys.key_frames)."""
    if bulk is not None and bulk.sharded:
        return ShardedFramePusher(client, keys, bulk, count_key_frames)
    return FramePusher(client, keys, count_key_frames)
