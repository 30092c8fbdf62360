
-- The step `take_decode_share` (contract.admission.decode_share.DecodeShare.take): a key's charged decodes in flight, one
-- hash. keys[1] the charges; args[1] the key, args[2] the job id, args[3] its cost, args[4] the key's share, args[5]
-- now, args[6] when this charge lapses. Lapsed charges are dropped on the way. {1, held with it} when charged,
-- {0, held} when refused.
redis.register_function('take_decode_share', function(keys, args)
  local held, now = 0, tonumber(args[5])
  local entries = redis.call('HGETALL', keys[1])
  for i = 1, #entries, 2 do
    local key, cost, lapse = string.match(entries[i + 1], '^(.*)|(%d+)|([%d.]+)$')
    if lapse == nil or tonumber(lapse) < now then
      redis.call('HDEL', keys[1], entries[i])
    elseif key == args[1] then
      held = held + tonumber(cost)
    end
  end
  local cost = tonumber(args[3])
  if held > 0 and held + cost > tonumber(args[4]) then return {0, held} end
  redis.call('HSET', keys[1], args[2], args[1] .. '|' .. args[3] .. '|' .. args[6])
  return {1, held + cost}
end)
