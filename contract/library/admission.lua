
-- A job's admission (contract.admission.budget): its model's backlog, the tenant's share of it, both byte budgets and the API
-- key's share of each, judged and the bytes reserved in one step. admit(keys, args, k, last, a): keys[k] the
-- model's frame list, keys[k + 1] the frames-waiting hash (with bulk shards, the frames on them: contract.redis.shards;
-- '' without), keys[k + 2] the waiting-bytes hash, keys[k + 3] the tenant's own CPU queue, keys[k + 4] the API
-- key's waiting-bytes hash ('' without a key), keys[k + 5..last] the model's other CPU queues; args[a] the model,
-- args[a + 1] the bytes to reserve, args[a + 2] its backlog limit (jobs), args[a + 3] its byte budget, args[a + 4]
-- the total's, args[a + 5] how many jobs the tenant may have waiting in its own queue, args[a + 6] and args[a + 7]
-- the key's share of the model's budget and of the total (ADMISSION_ARGS: 8, budget.admission_arguments).
-- `pending`: messages of the job judged on the tenant's queue already (take_in's), not counted.
-- Returns {verdict, backlog, model bytes, all bytes, the key's bytes, the key's share} (after the reservation when
-- admitted; the key's: of the model, or of all models when that share refused it; its share: what refused it, 0 when
-- no share did). ALL is contract.admission.budget's.
-- A key's share is of what the others leave: it may hold `share` x (limit - what the rest of the total holds) /
-- limit, the rest being every other key's and the frames' (nobody's), so n flooding keys leave about limit/(n + 1)
-- of it to the next key where a share of the whole let two fill it; alone and with no frames waiting it is the
-- whole share, as before. The figures are those read for the verdict: no read more.
local ALL = '*'

local function share_left(share, limit, total, held)
  if limit <= 0 then return share end
  return math.floor(share * math.max(0, limit - (total - held)) / limit)
end

local function admit(keys, args, k, last, a, pending)
  local own = redis.call('LLEN', keys[k + 3]) - (pending or 0)
  local sharded = 0   -- without bulk shards the key is '': no frames wait there, no HGET an image to say so
  if keys[k + 1] ~= '' then
    sharded = (redis.call('HGET', keys[k + 1], args[a]) or 0) + 0   -- a count kept with HINCRBY (head.lua: numbers)
    if sharded < 0 then sharded = 0 end
  end
  local backlog = redis.call('LLEN', keys[k]) + sharded + own
  for i = k + 5, last do backlog = backlog + redis.call('LLEN', keys[i]) end
  local waiting = redis.call('HGETALL', keys[k + 2])   -- a field a model: the total is their sum
  local model_bytes, all_bytes = 0, 0
  for i = 1, #waiting, 2 do
    if waiting[i] ~= ALL then
      local bytes = waiting[i + 1] + 0   -- counts kept with HINCRBY
      if bytes < 0 then bytes = 0 end
      all_bytes = all_bytes + bytes
      if waiting[i] == args[a] then model_bytes = bytes end
    end
  end
  local key_model, key_all = 0, 0   -- the key's, the same way (no key: no read)
  if keys[k + 4] ~= '' then
    local mine = redis.call('HGETALL', keys[k + 4])
    for i = 1, #mine, 2 do
      local bytes = mine[i + 1] + 0
      if bytes < 0 then bytes = 0 end
      key_all = key_all + bytes
      if mine[i] == args[a] then key_model = bytes end
    end
  end
  local size = args[a + 1] + 0
  local limit, model_limit, all_limit = args[a + 2] + 0, args[a + 3] + 0, args[a + 4] + 0
  -- held + this one <= share x (limit - the rest) / limit, multiplied out: no call into C on an admission (each
  -- costs Redis far more than the arithmetic); the share at that moment is worked out for a refusal alone. A key with
  -- nothing waiting is admitted by its share whatever is left and whatever the size (the budgets still apply); a
  -- job-count share of the whole is the backlog's own limit, whose refusal is the model's.
  if own > 0 then
    local share = args[a + 5] + 0
    if share < limit and (own + 1) * limit > share * (limit - backlog + own) then
      return {'tenant_backlog', own, model_bytes, all_bytes, key_model, share_left(share, limit, backlog, own)}
    end
  end
  if key_model > 0 then
    local share = args[a + 6] + 0
    if (key_model + size) * model_limit > share * (model_limit - model_bytes + key_model) then
      local left = share_left(share, model_limit, model_bytes, key_model)
      return {'key_model_bytes', backlog, model_bytes, all_bytes, key_model, left}
    end
  end
  if key_all > 0 then
    local share = args[a + 7] + 0
    if (key_all + size) * all_limit > share * (all_limit - all_bytes + key_all) then
      local left = share_left(share, all_limit, all_bytes, key_all)
      return {'key_all_bytes', backlog, model_bytes, all_bytes, key_all, left}
    end
  end
  if backlog >= limit then return {'backlog', backlog, model_bytes, all_bytes, key_model} end
  if model_bytes + size > model_limit then
    return {'model_bytes', backlog, model_bytes, all_bytes, key_model}
  end
  if all_bytes + size > all_limit then
    return {'all_bytes', backlog, model_bytes, all_bytes, key_model}
  end
  -- the size as it was sent: a Lua number passed to redis.call is formatted anew (`%.17g`; plane-cuts.md, round four)
  if size > 0 then redis.call('HINCRBY', keys[k + 2], args[a], args[a + 1]) end
  if keys[k + 4] == '' then return {'admitted', backlog, model_bytes + size, all_bytes + size, 0} end
  if size > 0 then redis.call('HINCRBY', keys[k + 4], args[a], args[a + 1]) end
  return {'admitted', backlog, model_bytes + size, all_bytes + size, key_model + size}
end

-- The step `admit` (WaitingBytes.admit): admit()'s keys and arguments, from keys[1] and args[1].
redis.register_function('admit', function(keys, args) return admit(keys, args, 1, #keys, 1) end)

-- The step `release_bytes` (WaitingBytes.release): keys[1] the waiting-bytes hash; args[1] the model, args[2] the
-- bytes, args[3] the API key they were reserved for ('' without).
redis.register_function('release_bytes', function(keys, args)
  release_waiting(keys[1], args[1], args[2], args[3])
end)
