
-- The CPU hop's recoveries (tasks.hop.broker, tasks.hop.lost_deliveries).

-- The step `may_reap_cpu_worker` (tasks.hop.broker.reap_dead_workers): keys[1] the worker's heartbeat, keys[2] the
-- reaping lock; args[1] the reaper, args[2] the lock's TTL (s). 1: the worker is dead and this reaper may give back
-- its messages; 0: it lives, or another reaper has it.
redis.register_function('may_reap_cpu_worker', function(keys, args)
  if redis.call('EXISTS', keys[1]) == 1 then return 0 end
  if redis.call('SET', keys[2], args[1], 'NX', 'EX', tonumber(args[2])) then return 1 end
  return 0
end)

-- The step `resend_task` (tasks.hop.lost_deliveries): keys[1] the job hash, keys[2] its queue's list; args[1] the
-- message, args[2] the most times a job is sent its task again, args[3] its `resent` count as this round read it.
-- The message goes to the end BRPOP takes from (the front), only while the job is still queued, has not been sent it
-- that often, and nobody sent it again since this round looked (a round that outlived its lock, beside the next one,
-- must not send a second copy): 1 sent, 0 not.
redis.register_function('resend_task', function(keys, args)
  if redis.call('HGET', keys[1], 'status') ~= QUEUED then return 0 end
  local resent = tonumber(redis.call('HGET', keys[1], 'resent') or '0')
  if resent ~= tonumber(args[3]) or resent >= tonumber(args[2]) then return 0 end
  redis.call('RPUSH', keys[2], args[1])
  redis.call('HINCRBY', keys[1], 'resent', 1)
  return 1
end)
