
-- Token buckets (contract.admission.token_bucket). refilled(tokens, at, now, rate, burst): a bucket's tokens at `now` and its
-- new mark, from what it held at its mark `at` (nil: a new bucket, full); every bucket of the service refills by it
-- (the cache hits': hits.lua). The mark never moves back: each API process carries the clock forward on its own,
-- and a request that ran later may bring an earlier moment.
local function refilled(tokens, at, now, rate, burst)
  at = tonumber(at) or now
  if now < at then now = at end
  return math.min(burst, (tonumber(tokens) or burst) + (now - at) * rate), now
end

-- The step `take_token` (TokenBuckets.take): keys[1] the bucket hash; args[1] the rate (tokens/s), args[2] the
-- burst, args[3] now (the service's clock). Returns {allowed, retry_after_ms}.
redis.register_function('take_token', function(keys, args)
  local rate, burst = tonumber(args[1]), tonumber(args[2])
  local state = redis.call('HMGET', keys[1], 'tokens', 'at')
  local tokens, now = refilled(state[1], state[2], tonumber(args[3]), rate, burst)
  local allowed = 0
  if tokens >= 1 then
    tokens = tokens - 1
    allowed = 1
  end
  redis.call('HSET', keys[1], 'tokens', tostring(tokens), 'at', tostring(now))
  redis.call('PEXPIRE', keys[1], math.ceil(burst / rate * 1000) + 1000)
  if allowed == 1 then return {1, 0} end
  return {0, math.ceil((1 - tokens) / rate * 1000)}
end)
