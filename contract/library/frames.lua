
-- The frame list's ack, the one place a frame is acked (contract.frame_source): drop the `count` oldest frames of a
-- processing list, the batch just answered.
local function ack_frames(processing, count)
  if count > 0 then redis.call('LTRIM', processing, 0, -(count + 1)) end
end
