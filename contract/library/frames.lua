
-- The frame list's ack, the one place a frame is acked (contract.frames.frame_source): drop the `count` oldest frames of a
-- processing list, the batch just answered.
local function ack_frames(processing, count)
  if count > 0 then redis.call('LTRIM', processing, '0', string.format('%d', -(count + 1))) end
end

-- A frame's job id, or nil when its header is unreadable (contract.frames: the magic's 4 bytes, the header's length
-- as a big-endian 32-bit integer, then the JSON header; FRAME_PREFIX_BYTES is its prefix's 8, a test holds them
-- together). `struct` and `cjson` are Redis's own Lua libraries.
local FRAME_PREFIX_BYTES = 8
local function frame_job_id(frame)
  local ok, header = pcall(function()
    local length = struct.unpack('>I4', string.sub(frame, 5, FRAME_PREFIX_BYTES))
    return cjson.decode(string.sub(frame, FRAME_PREFIX_BYTES + 1, FRAME_PREFIX_BYTES + length))
  end)
  if ok and type(header) == 'table' and type(header.job_id) == 'string' then return header.job_id end
  return nil
end

-- The step `ack_frames` (RedisFrameSource.ack, a source's ack alone: the batch write acks in its own step): keys[1]
-- the processing list, keys[2..] uploads that waited for these frames (bulk shards keep a job's bytes until its
-- frame is acked: contract.frames.frame_shard_source); args[1] the count.
redis.register_function('ack_frames', function(keys, args)
  ack_frames(keys[1], tonumber(args[1]))
  for i = 2, #keys do redis.call('DEL', keys[i]) end
  return 1
end)

-- Giving a worker's unanswered frames back (contract.frames.frame_source.requeue_frames_of), on the control plane and
-- wherever its lists lie, in three steps: the fence, the move, the count.
-- The step `fence_worker`, on the control plane: keys[1] the worker's heartbeat ('' when it gives back its own),
-- keys[2] its epoch. -1 if it lives; else 1, its epoch deleted (a paused worker finds it gone and writes nothing).
redis.register_function('fence_worker', function(keys)
  if keys[1] ~= '' then
    if redis.call('EXISTS', keys[1]) == 1 then return -1 end
    redis.call('DEL', keys[2])
  end
  return 1
end)

-- The step `move_frames_back`, where the lists lie: the worker's processing lists back to their frame lists, oldest
-- first in line; the job ids read from the moved frames' headers ('' for a frame without one). keys: per model its
-- processing list and its frame list. Two reapers cannot both move a frame: the second finds the list empty.
redis.register_function('move_frames_back', function(keys)
  local moved = {}
  for k = 1, #keys, 2 do
    while true do
      local frame = redis.call('LMOVE', keys[k], keys[k + 1], 'LEFT', 'RIGHT')
      if not frame then break end
      moved[#moved + 1] = frame_job_id(frame) or ''
    end
  end
  return moved
end)

-- The step `count_attempts`, on the control plane: an attempt more on each job (keys) that still exists (a step
-- towards `poison`).
redis.register_function('count_attempts', function(keys)
  for _, key in ipairs(keys) do
    if redis.call('EXISTS', key) == 1 then redis.call('HINCRBY', key, 'attempts', 1) end
  end
  return #keys
end)
