
-- The step `store_hit` (JobIntake's cache hit, contract.jobs.hits): the hit's job stored ended at once, charged to
-- its API key's bucket, holding a reference to the shared answer. keys[1] the callback outbox, keys[2] the entry,
-- keys[3] the LRU set, keys[4] the stats hash, keys[5] the shared answer (Keys.hit_result), keys[6] the key's hit
-- bucket, keys[7] the job hash; args[1..FINISH_NAMES] finish_names(), then, at N = FINISH_NAMES: args[N + 1] the
-- digest, args[N + 2] now, args[N + 3] the cache TTL, args[N + 4] the model, args[N + 5] the shared answer's TTL,
-- args[N + 6] the bucket's bytes (0: no bound), args[N + 7] its refill a second, args[N + 8] this hit's charge,
-- args[N + 9] how many `jobs.ttl_s` the shared answer may live (what its copy is charged for), args[N + 10] the
-- count of record field and value arguments, the record's, and the job's end (finish_arguments). Returns
-- {'ended', status} (`expired` when the hit came after the job's deadline: finish_jobs ends it so, and its answer
-- is not referred to), {'limited', ms until the bucket holds the charge} with nothing written, or {HIT_GONE}.
-- `store_hit_answer`, the same with the cache on a Redis of its own (contract.cache.cache_plane): the answer is the last
-- argument (the lookup read it there), keys[2..4] are not touched (the hit's books are written there after), and
-- the shared answer is SET from it.
local HIT_GONE = 'gone'

local function store_hit(keys, args, document)
  local N = FINISH_NAMES
  local digest, now, cache_ttl, model = args[N + 1], tonumber(args[N + 2]), args[N + 3], args[N + 4]
  local answer_ttl, capacity = tonumber(args[N + 5]), tonumber(args[N + 6])
  local refill, charge, lifetimes = tonumber(args[N + 7]), tonumber(args[N + 8]), tonumber(args[N + 9])
  if not document and redis.call('EXPIRE', keys[2], cache_ttl) == 0 then return {HIT_GONE} end
  local fresh = redis.call('EXISTS', keys[5]) == 0
  if fresh then charge = charge + (document and #document or redis.call('STRLEN', keys[2])) * lifetimes end
  if capacity > 0 then   -- the key's bucket, refilled since its last hit; a charge over the whole waits for it full
    local held, at = string.match(redis.call('GET', keys[6]) or '', '^(%S+) (%S+)$')
    local tokens, mark = refilled(held, at, now, refill, capacity)
    charge = math.min(charge, capacity)
    if tokens < charge then return {'limited', math.ceil((charge - tokens) / refill * 1000)} end
    -- '<tokens> <mark>', living until it would be full again: one string, two commands
    redis.call('SET', keys[6], string.format('%.17g %.17g', tokens - charge, mark), 'EX',
               math.ceil(capacity / refill) + 1)
  end
  if not document then
    redis.call('ZADD', keys[3], 'XX', args[N + 2], digest)
    redis.call('HINCRBY', keys[4], model .. ':hits', 1)
  end
  local names = finish_names(keys[1], args, 1)
  local at = N + 10
  local count = tonumber(args[at])
  redis.call('HSET', keys[7], unpack(args, at + 1, at + count))
  redis.call('EXPIRE', keys[7], names.ttl)
  finish_jobs(keys, args, names, 7, at + 1 + count)
  local status = redis.call('HGET', keys[7], 'status')
  if status == SUCCEEDED then   -- in time: its answer is the shared one, kept as long as this record may live
    if fresh and document then
      redis.call('SET', keys[5], document, 'EX', answer_ttl)
    elseif fresh then
      redis.call('COPY', keys[2], keys[5])
      redis.call('EXPIRE', keys[5], answer_ttl)
    else
      redis.call('EXPIRE', keys[5], answer_ttl, 'GT')
    end
  end                           -- else answered after its deadline: expired as any late answer, without it
  return {'ended', status}
end

redis.register_function('store_hit', function(keys, args) return store_hit(keys, args, nil) end)
redis.register_function('store_hit_answer', function(keys, args) return store_hit(keys, args, args[#args]) end)
