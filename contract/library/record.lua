
-- The step `advance_jobs` (JobStore.advance): each job moved on, unless it is over or has run out of attempts.
-- keys: job hashes; args[1] max attempts (0: no limit), args[2..] field, value, ... (the same for each job).
-- Per job: MOVED (1), GONE (0: absent or terminal), or POISON (-1, unchanged: requeued max attempts times).
redis.register_function('advance_jobs', function(keys, args)
  local limit = args[1] + 0
  local verdicts = {}
  for i = 1, #keys do   -- not ipairs: its iterator is a C call a job
    local key = keys[i]
    local was = redis.call('HMGET', key, 'status', 'attempts')
    local status = was[1]
    if not status or TERMINAL[status] then
      verdicts[i] = 0
    elseif limit > 0 and was[2] and was[2] + 0 >= limit then   -- attempts: a count kept with HINCRBY
      verdicts[i] = -1
    else
      redis.call('HSET', key, unpack(args, 2))
      verdicts[i] = 1
    end
  end
  return verdicts
end)
