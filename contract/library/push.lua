
-- The push (contract.frames.frame_push; over bulk shards, contract.frames.frame_shards): what it checks and does, in the same
-- commands either way. live_job: the job's status, model, upload's bytes, claim, API key (its owner) and upload
-- marker, in one HMGET; a job gone or ended loses its upload (its bytes given back) and nil says the frame may not stand.
-- release_upload: the upload goes, its bytes given back (the model's and its key's). trade_upload_for_frame, once
-- the step's DEL took the upload (a DEL that finds none says the job is not this attempt's to push: no EXISTS
-- first): the frame's bytes wait in Redis instead of the upload's, until the GPU worker's batch write gives them
-- back: one HINCRBY a counter for the difference, with the result a release then a charge would give. A key's bytes
-- are its uploads alone: its upload's leave its count here. The frame's API key counted it in at its claim
-- (handoff.lua): the push counts nothing.
local PUSHED, LIST_FULL, JOB_OVER = 1, 0, -1   -- contract.frames.frame_push's

local function release_upload(marker, upload, waiting, model, upload_bytes, owner)
  if take_upload(marker, upload) == 1 then release_waiting(waiting, model, upload_bytes, owner) end
end

-- ... and the upload's marker (ending.lua's take_upload), the last value returned.
local function live_job(job, upload, waiting)
  local was = redis.call('HMGET', job, 'status', 'model', 'bytes', 'claim', 'owner', UPLOAD_FIELD)
  local status, model, upload_bytes, owner, marker = was[1], was[2], was[3], was[5], was[6]
  if not status or TERMINAL[status] then
    release_upload(marker, upload, waiting, model, upload_bytes, owner)
    if status and marker == SHARDED_UPLOAD then redis.call('HSET', job, UPLOAD_FIELD, '') end
    return nil
  end
  return status, model, upload_bytes, was[4], owner, marker
end

local function trade_upload_for_frame(waiting, model, upload_bytes, frame_bytes, owner)
  local uploaded = upload_bytes and upload_bytes + 0 or 0   -- the record's `bytes` (head.lua: numbers)
  if uploaded < 0 then uploaded = 0 end
  local change = frame_bytes - uploaded
  if model and model ~= '' and redis.call('HINCRBY', waiting, model, string.format('%d', change)) < frame_bytes then
    redis.call('HSET', waiting, model, string.format('%d', frame_bytes))
  end
  if model and owner and owner ~= '' then
    release_field(key_waiting(waiting, owner), model, uploaded)
  end
end

-- The step `keep_pushed_frame` (FramePusher.push), in the same MULTI as the frame's LPUSH (the tail) or RPUSH (the
-- head): keeps the frame only if it may be there (the job still `preprocessing` with its upload and this claim, a
-- tail frame's list within its bound), else drops it again (LTRIM at its end: nothing in a transaction runs
-- between the two) and says why. keys[1] the job hash, keys[2] the frame list, keys[3] the upload, keys[4] the
-- waiting bytes; args[1] max frames, args[2] the claim,
-- args[3] the frame's length, args[4] '1' when the frame went to the head, args[5..] field, value, ... Returns
-- PUSHED, LIST_FULL (nothing changed) or JOB_OVER (gone, over or claimed by another: nothing pushed).
redis.register_function('keep_pushed_frame', function(keys, args)
  local head = args[4] == '1'
  local function take_back()
    if head then redis.call('LTRIM', keys[2], 0, -2) else redis.call('LTRIM', keys[2], 1, -1) end
  end
  local status, model, upload_bytes, claim, owner = live_job(keys[1], keys[3], keys[4])
  if not status or status ~= PREPROCESSING or (claim and claim ~= args[2]) then
    take_back()
    return JOB_OVER
  end
  if not head and redis.call('LLEN', keys[2]) > tonumber(args[1]) then
    take_back()
    return LIST_FULL
  end
  if redis.call('DEL', keys[3]) == 0 then   -- its upload gone: a redelivered task's race, or a lost shard
    take_back()
    return JOB_OVER
  end
  redis.call('HSET', keys[1], unpack(args, 5))
  trade_upload_for_frame(keys[4], model, upload_bytes, args[3] + 0, owner)
  return PUSHED
end)

-- The step `mark_pushed` (ShardedFramePusher.push), on the control plane once the frame is on its shard: whether it
-- may stand, as keep_pushed_frame's checks, and a job already `running` with this claim is the frame's own (a GPU
-- worker took it before this step ran: the stamps are written, the status and the frame's bytes are left alone).
-- The frame is counted among its model's frames on the shards (Keys.frames_waiting). keys[1] the job hash, keys[2]
-- the upload's marker key (read only for a record an older API stored without the marker field), keys[3] the
-- waiting bytes, keys[4] the frames waiting; args[1] the claim, args[2] the frame's length, args[3..] field, value, ...
-- Returns PUSHED or JOB_OVER (the caller takes the frame back).
redis.register_function('mark_pushed', function(keys, args)
  local status, model, upload_bytes, claim, owner, marker = live_job(keys[1], keys[2], keys[3])
  if not status then return JOB_OVER end
  if (claim and claim ~= args[1]) or (status ~= PREPROCESSING and status ~= RUNNING) then return JOB_OVER end
  if status == RUNNING then   -- its frame is in a batch already: the stamps alone
    redis.call('HSET', keys[1], UPLOAD_FIELD, '', unpack(args, 3))
    release_upload(marker, keys[2], keys[3], model, upload_bytes, owner)
    return PUSHED
  end
  if take_upload(marker, keys[2]) == 0 then return JOB_OVER end
  redis.call('HSET', keys[1], 'status', QUEUED_GPU, UPLOAD_FIELD, '', unpack(args, 3))
  if model then redis.call('HINCRBY', keys[4], model, '1') end
  trade_upload_for_frame(keys[3], model, upload_bytes, args[2] + 0, owner)
  return PUSHED
end)

-- The step `keep_within_bound` (ShardedFramePusher.push), on the job's bulk shard, in the same MULTI as the frame's
-- push: the frame kept only within the shard's bound; one pushed to the head (its key's frames are few) passes it.
-- keys[1] the frame list; args[1] its bound, args[2] '1' for a head frame. Returns 1 kept, 0 dropped again.
redis.register_function('keep_within_bound', function(keys, args)
  if args[2] ~= '1' and redis.call('LLEN', keys[1]) > tonumber(args[1]) then
    redis.call('LTRIM', keys[1], 1, -1)
    return 0
  end
  return 1
end)
