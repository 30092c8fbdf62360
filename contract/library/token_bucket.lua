
-- Token buckets (contract.admission.token_bucket). refilled(tokens, at, now, rate, burst): a bucket's tokens at `now` and its
-- new mark, from what it held at its mark `at` (nil: a new bucket, full); every bucket of the service refills by it
-- (the cache hits': hits.lua). The mark never moves back: each API process carries the clock forward on its own,
-- and a request that ran later may bring an earlier moment.
local function refilled(tokens, at, now, rate, burst)
  at = tonumber(at) or now
  if now < at then now = at end
  return math.min(burst, (tonumber(tokens) or burst) + (now - at) * rate), now
end

-- What a key's answers hold in the store (contract.jobs.hits): one bucket a key, '<tokens> <mark>' (a string living
-- until it would be full again), that its cache hits take from before they are stored and the GPU worker's batch
-- write debits its computed answers from after (debit_answers). A computed answer is never lost for a bucket short of
-- it: the bucket goes into debt, and while it is there its debt marker (the bucket's name and DEBT_SUFFIX:
-- Keys.answer_debt) lives until the refill has paid it, so the admission (take_in) reads it with one PTTL, needing
-- neither the clock nor the rate. debit_answers(args, at, count): args[at..] the bucket's bytes, its refill a second,
-- now, then (bucket, bytes) pairs: `count` arguments in all (0: nothing).
local DEBT_SUFFIX = ':debt'

local function debit_answers(args, at, count)
  if count == 0 then return end
  local capacity, refill, now = tonumber(args[at]), tonumber(args[at + 1]), tonumber(args[at + 2])
  for i = at + 3, at + count - 1, 2 do
    local bucket = args[i]
    local held, mark = string.match(redis.call('GET', bucket) or '', '^(%S+) (%S+)$')
    local tokens
    tokens, mark = refilled(held, mark, now, refill, capacity)
    tokens = tokens - tonumber(args[i + 1])
    redis.call('SET', bucket, string.format('%.17g %.17g', tokens, mark), 'EX',
               math.ceil((capacity - tokens) / refill) + 1)
    if tokens < 0 then redis.call('SET', bucket .. DEBT_SUFFIX, '1', 'PX', math.ceil(-tokens / refill * 1000)) end
  end
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
