
-- The step `advance_jobs` (JobStore.advance): each job moved on, unless it is over or has run out of attempts.
-- keys: job hashes; args[1] max attempts (0: no limit), args[2..] field, value, ... (the same for each job).
-- Per job: MOVED (1), GONE (0: absent or terminal), or POISON (-1, unchanged: requeued max attempts times).
redis.register_function('advance_jobs', function(keys, args)
  local limit = tonumber(args[1])
  local verdicts = {}
  for i, key in ipairs(keys) do
    local was = redis.call('HMGET', key, 'status', 'attempts')
    local status = was[1]
    if not status or TERMINAL[status] then
      verdicts[i] = 0
    elseif limit > 0 and tonumber(was[2] or '0') >= limit then
      verdicts[i] = -1
    else
      redis.call('HSET', key, unpack(args, 2))
      verdicts[i] = 1
    end
  end
  return verdicts
end)
