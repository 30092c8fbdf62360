"""The frame lists over bulk shards (contract.redis.shards), in: contract.frames.frame_push's push, a list per shard.

A job's frame lies on its upload's shard. `ShardedFramePusher.push` puts the frame onto the shard within the
shard's share of the bound, then asks the control plane's verdict on the job (the same checks as a push in one
Redis: the library's push.lua); a frame that may not stand is taken back. The way out over the shards is
contract.frames.frame_shard_source.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from contract.frames.frame_push import LIST_FULL, PUSHED, FramePusher
from contract.jobs.record import flatten_fields
from contract.library import Step, is_missing
from contract.redis.clock import now as service_now
from contract.redis.keys import UPLOAD_SUFFIX, Keys
from contract.redis.shards import SHARD_ERRORS, BulkPlane, ShardUnavailable

# The frame goes to the job's shard first, kept only within the shard's bound: the push and the library's
# `keep_within_bound` in one MULTI, on the shard (contract/library/push.lua).
_KEEP_WITHIN_BOUND = Step("keep_within_bound")

# ...then the library's `mark_pushed`, on the control plane, says whether the frame may stand
# (contract/library/push.lua, where its keys and arguments are named).
_MARK_PUSHED = Step("mark_pushed")


class ShardedFramePusher(FramePusher):
    """The CPU workers' end of the frame lists over bulk shards."""

    def __init__(self, client: redis.Redis, keys: Keys, bulk: BulkPlane) -> None:
        super().__init__(client, keys)
        self.bulk = bulk

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
        another, and the first one answered wins (contract.redis.shards' note). ShardUnavailable when the shard does
        not answer."""
        index = self.bulk.index(job_id)
        shard, frames = self.bulk.clients[index], self.keys.frames(model_key)
        try:
            kept = self._push_within_bound(shard, frames, frame, self.bulk.frame_bound(max_frames), head)
        except SHARD_ERRORS as exc:
            self.bulk.mark_down(index)
            raise ShardUnavailable(index, exc) from exc
        if not kept:
            return LIST_FULL
        stamps = flatten_fields({"updated_at": service_now(), **fields})
        outcome = int(
            _MARK_PUSHED(
                self.redis,
                [
                    self.job_prefix + job_id,  # the job's keys named here, as FramePusher.push's
                    self.job_prefix + job_id + UPLOAD_SUFFIX,
                    self.keys.waiting_bytes,
                    self.keys.frames_waiting,
                ],
                [claim, len(frame), *stamps],
            )
        )
        if outcome != PUSHED:
            try:
                shard.lrem(frames, 1, frame)  # type: ignore[arg-type]  # redis-py's stubs say str; bytes go
            except redis.RedisError:
                pass  # a GPU worker that takes it finds its job over (or another frame's) and skips it
        return outcome

    def _push_within_bound(self, shard: redis.Redis, frames: str, frame: bytes, bound: int, head: bool) -> int:
        """The frame onto the shard's list and `keep_within_bound`, in one MULTI: 1 kept, 0 dropped again."""
        for attempt in range(2):
            pipe = shard.pipeline(transaction=True)
            if head:
                pipe.rpush(frames, frame)
            else:
                pipe.lpush(frames, frame)
            _KEEP_WITHIN_BOUND(pipe, [frames], [bound, "1" if head else ""])
            kept = pipe.execute(raise_on_error=False)[1]
            if not is_missing(kept) or attempt:
                break
            # a shard that came back empty answered inside the transaction, after the push: the frame taken out
            # again, the library loaded there, the push made once more
            shard.lrem(frames, 1, frame)  # type: ignore[arg-type]  # redis-py's stubs say str; bytes go
            _KEEP_WITHIN_BOUND.recover(shard)
        if isinstance(kept, Exception):
            raise kept
        return int(kept)

    def has_room(self, job_id: str, model_key: str, max_frames: int) -> bool:
        """The job's shard's list, against its share of the bound."""
        return int(self.bulk.client_for(job_id).llen(self.keys.frames(model_key))) < self.bulk.frame_bound(max_frames)


def frame_pusher(client: redis.Redis, keys: Keys, bulk: BulkPlane | None = None) -> FramePusher:
    """The CPU workers' end of the frame lists: over `bulk`'s shards when it has any, else in `client`'s Redis."""
    if bulk is not None and bulk.sharded:
        return ShardedFramePusher(client, keys, bulk)
    return FramePusher(client, keys)
