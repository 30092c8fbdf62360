
-- A tenant's callback slots (tasks.callbacks.slots): taken before an attempt, given back after.

-- The step `take_callback_slot` (TenantSlots.take): keys[1] the tenant's slots, keys[2] its held list, keys[3] the
-- held tenants; args[1] now, args[2] a token, args[3] when it lapses, args[4] the cap, args[5] the job id, args[6]
-- the tenant. 1: a slot taken; 0: held.
redis.register_function('take_callback_slot', function(keys, args)
  redis.call('ZREMRANGEBYSCORE', keys[1], '-inf', args[1])
  if redis.call('ZCARD', keys[1]) < tonumber(args[4]) then
    redis.call('ZADD', keys[1], tonumber(args[3]), args[2])
    redis.call('EXPIREAT', keys[1], math.ceil(tonumber(args[3])) + 1)
    return 1
  end
  redis.call('RPUSH', keys[2], args[5])
  redis.call('SADD', keys[3], args[6])
  return 0
end)

-- The step `give_back_callback_slot` (TenantSlots.give_back): keys[1] the tenant's slots, keys[2] its held list,
-- keys[3] the held tenants, keys[4] the outbox; args[1] the token, args[2] the tenant. The slot given back, and the
-- first callback held for one handed on.
redis.register_function('give_back_callback_slot', function(keys, args)
  redis.call('ZREM', keys[1], args[1])
  local job_id = redis.call('LPOP', keys[2])
  if job_id then
    redis.call('RPUSH', keys[4], job_id)
    redis.call('PUBLISH', keys[4], job_id)
  end
  if redis.call('LLEN', keys[2]) == 0 then redis.call('SREM', keys[3], args[2]) end
  return job_id
end)

-- The step `free_lapsed_callback_slots` (TenantSlots.free_lapsed): keys[1] the held tenants, keys[2] the outbox;
-- args[1] the slots' key prefix, args[2] the held lists' prefix, args[3] now, args[4] the cap. For each tenant with
-- callbacks held: its lapsed slots dropped, and as many held ones moved to the outbox as it has slots free. Returns
-- how many moved.
redis.register_function('free_lapsed_callback_slots', function(keys, args)
  local moved = 0
  for _, tenant in ipairs(redis.call('SMEMBERS', keys[1])) do
    local slots, held = args[1] .. tenant, args[2] .. tenant
    redis.call('ZREMRANGEBYSCORE', slots, '-inf', args[3])
    local free = tonumber(args[4]) - redis.call('ZCARD', slots)
    while free > 0 do
      local job_id = redis.call('LPOP', held)
      if not job_id then break end
      redis.call('RPUSH', keys[2], job_id)
      free = free - 1
      moved = moved + 1
    end
    if redis.call('LLEN', held) == 0 then redis.call('SREM', keys[1], tenant) end
  end
  if moved > 0 then redis.call('PUBLISH', keys[2], 'held') end
  return moved
end)
