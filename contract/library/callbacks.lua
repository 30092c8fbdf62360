
-- A callback's delivery (tasks.callbacks.delivery, tasks.callbacks.relay).

-- What a dead letter drops of its record: the stages' own bookkeeping (tasks.callbacks.DEAD_LETTER_DROPS; a test
-- holds the two together). It keeps what a read and a redelivery need: the job's document, its owner and callback.
local DEAD_LETTER_DROPS = {
  'claim', 'queue', 'resent', 'cache_key', 'decode_cost', 'media_type', 'bytes', 'submitted_at', 'cpu_started_at',
  'decode_ms', 'resize_ms', 'backpressure_ms', 'pushed_at'
}

-- The step `record_callback_state` (CallbackSender): keys[1] the job hash, keys[2] the scheduled set, keys[3] the
-- dead set; args[1] the job id, args[2] the callback state (JSON), args[3] 'scheduled' | 'dead' | '' (where the job
-- id waits next), args[4] its score, args[5] the least TTL the record must keep (a callback retried for hours needs
-- its job; never past jobs.max_ttl_s from its submission). A job hash that expired meanwhile is not recreated by a
-- late write. Returns 1 written, 0 gone.
redis.register_function('record_callback_state', function(keys, args)
  if redis.call('EXISTS', keys[1]) == 0 then return 0 end
  redis.call('HSET', keys[1], 'callback', args[2])
  redis.call('ZREM', keys[2], args[1])
  redis.call('ZREM', keys[3], args[1])
  if args[3] == 'scheduled' then
    redis.call('ZADD', keys[2], tonumber(args[4]), args[1])
  elseif args[3] == 'dead' then
    redis.call('ZADD', keys[3], tonumber(args[4]), args[1])
    redis.call('HDEL', keys[1], unpack(DEAD_LETTER_DROPS))
  end
  local keep = tonumber(args[5])
  if keep > 0 and redis.call('TTL', keys[1]) < keep then redis.call('EXPIRE', keys[1], keep) end
  return 1
end)

-- The step `take_from_outbox` (tasks.callbacks.relay.relay_outbox): keys[1] the outbox, keys[2] relaying (zset),
-- keys[3] scheduled (zset); args[1] now, args[2] taken before this is stale. Retries that are due and entries a dead
-- relay held go to the outbox first; then one entry moves from the outbox to `relaying`.
redis.register_function('take_from_outbox', function(keys, args)
  local due = redis.call('ZRANGEBYSCORE', keys[3], '-inf', args[1], 'LIMIT', 0, 100)
  for _, job_id in ipairs(due) do
    redis.call('ZREM', keys[3], job_id)
    redis.call('RPUSH', keys[1], job_id)
  end
  local stale = redis.call('ZRANGEBYSCORE', keys[2], '-inf', args[2])
  for _, job_id in ipairs(stale) do
    redis.call('ZREM', keys[2], job_id)
    redis.call('RPUSH', keys[1], job_id)
  end
  local job_id = redis.call('LPOP', keys[1])
  if job_id then
    redis.call('ZADD', keys[2], args[1], job_id)
  end
  return job_id
end)
