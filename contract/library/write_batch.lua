
-- The step `write_batch`, the GPU worker's batch write (gpu_worker.finish.Finisher): ends every job of the batch,
-- acknowledges every frame it took, counts them out of their API keys' and counts the model's frames answered (the
-- drain rate's: app.drain; the worker's other counters are its heartbeat's, gpu_beat), atomically. keys[1] the callback
-- outbox, keys[2] the processing list ('' with bulk shards: the source acks there after this), keys[3] the counters
-- hash, keys[4] the worker's epoch, keys[5] the frames-waiting hash (bulk shards), keys[6] the model's frames by API
-- key (Keys.key_frames; '': not counted), keys[7..] job hashes; args[1..FINISH_NAMES] JobEnding.finish_names(), then,
-- at N = FINISH_NAMES: args[N + 1] frames to acknowledge (the oldest in hand), args[N + 2] their bytes, args[N + 3]
-- their model, args[N + 4] the count of counter field and value arguments, args[N + 5] the epoch the batch was taken in
-- ('': unfenced), args[N + 6] the count of key and frames arguments, args[N + 7] the count of answer-debit arguments
-- (`write_batch_debited` alone; `write_batch`, as library version 6 and the GPU workers of its release call it, has
-- neither that argument nor the debits), then the counters, then the keys' (an API key id, its frames among those
-- acknowledged: counted out, a count at 0 or below deleted), then the debits (debit_answers, token_bucket.lua: each
-- key's answers of this batch taken from its bucket once), then the jobs' (JobEnding.finish_arguments). Returns the
-- jobs ended, or -1 (nothing written) when the epoch is no longer the worker's. With the cache on a Redis of its own
-- (its max_bytes passed as -1: CacheLimits.finish_names), {ended, job id, digest, ...} of the jobs whose entries the
-- worker then stores there (contract.cache.cache_plane): a write after this step's, which may only ever be lost.
local function write_batch(keys, args, debiting)
  local N = FINISH_NAMES
  local D = debiting and 1 or 0   -- args[N + 7], the debits' count, in write_batch_debited alone
  if args[N + 5] ~= '' and redis.call('GET', keys[4]) ~= args[N + 5] then
    return -1   -- this worker was presumed dead: its frames are another's now (gpu_worker.heartbeat)
  end
  local names = finish_names(keys[1], args, 1)
  local acked, acked_bytes, model, counters = args[N + 1] + 0, args[N + 2], args[N + 3], args[N + 4] + 0
  if acked > 0 then
    if keys[2] ~= '' then
      ack_frames(keys[2], acked)
    elseif redis.call('HINCRBY', keys[5], model, string.format('%d', -acked)) < 0 then   -- on bulk shards: acked
      redis.call('HSET', keys[5], model, '0')   -- after, counted out here
    end
    release_waiting(names.waiting, model, acked_bytes)   -- the frames leave Redis: their bytes wait no more
  end
  if counters > 0 then
    redis.call('HSET', keys[3], unpack(args, N + 7 + D, N + 6 + D + counters))
  end
  local owned, debits, at = args[N + 6] + 0, debiting and args[N + 7] + 0 or 0, N + 7 + D + counters
  if keys[6] ~= '' then
    for i = at, at + owned - 1, 2 do
      if redis.call('HINCRBY', keys[6], args[i], string.format('%d', -tonumber(args[i + 1]))) <= 0 then
        redis.call('HDEL', keys[6], args[i])
      end
    end
  end
  debit_answers(args, at + owned, debits)
  local ended, entries = finish_jobs(keys, args, names, 7, at + owned + debits)
  if names.cache.max >= 0 then return ended end
  local reply = {ended}
  for _, entry in ipairs(entries) do
    reply[#reply + 1] = entry[4]
    reply[#reply + 1] = entry[1]
  end
  return reply
end

redis.register_function('write_batch', function(keys, args) return write_batch(keys, args, false) end)
redis.register_function('write_batch_debited', function(keys, args) return write_batch(keys, args, true) end)
