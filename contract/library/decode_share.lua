
-- A key's charged decodes in flight, one hash (contract.admission.decode_share). take_decode(charges, key, job, cost,
-- share, now, lapse): `cost` charged to `key` for `job` until `lapse` unless what the key holds already would pass
-- `share` with it; lapsed charges are dropped on the way. {1, held with it} when charged, {0, held} when refused.
local function take_decode(charges, key, job, cost, share, now, lapse)
  local held = 0
  now = tonumber(now)
  local entries = redis.call('HGETALL', charges)
  for i = 1, #entries, 2 do
    local owner, charged, lapses = string.match(entries[i + 1], '^(.*)|(%d+)|([%d.]+)$')
    if lapses == nil or tonumber(lapses) < now then
      redis.call('HDEL', charges, entries[i])
    elseif owner == key then
      held = held + tonumber(charged)
    end
  end
  if held > 0 and held + tonumber(cost) > tonumber(share) then return {0, held} end
  redis.call('HSET', charges, job, key .. '|' .. cost .. '|' .. lapse)
  return {1, held + tonumber(cost)}
end

-- The step `take_decode_share` (contract.admission.decode_share.DecodeShare.take): keys[1] the charges; args[1] the
-- key, args[2] the job id, args[3] its cost, args[4] the key's share, args[5] now, args[6] when this charge lapses.
redis.register_function('take_decode_share', function(keys, args)
  return take_decode(keys[1], args[1], args[2], args[3], args[4], args[5], args[6])
end)
