
-- The step `lookup_or_admit` (JobIntake.answer_or_admit): a result-cache lookup (contract.cache) and, on a miss,
-- the job's admission (admit, admission.lua), in one round trip. On a hit: the cached document, nothing written
-- (the hit's own step follows). keys[1] the entry, keys[2..] admit()'s keys; args admit()'s ADMISSION_ARGS.
-- Returns {'hit', document} or admit()'s verdict.
redis.register_function('lookup_or_admit', function(keys, args)
  local document = redis.call('GET', keys[1])
  if document then return {'hit', document} end
  return admit(keys, args, 2, #keys, 1)
end)

-- The step `take_in` (JobIntake.take_in): a new job's whole intake in one round trip. The result cache's lookup (a
-- hit: its document, nothing kept), the admission (admit: refused, nothing kept), the decode charge (refused: the
-- bytes just reserved given back, nothing kept), then the job: its record, its deadline entry, its Celery message.
-- An upload stored on this Redis before the step, in its transaction or alone, is deleted when no job is made.
-- keys[1] the cache entry ('': no lookup), keys[2] the record, keys[3] the deadline index, keys[4] the task's list
-- ('': no task), keys[5] the upload stored here before the step ('': on a bulk shard), keys[6] the decode charges
-- ('': no charge), keys[7] the waiting-bytes hash, keys[8..] admit()'s (none: admitted before the body was read).
-- args[1] the record's TTL, args[2] its deadline ('': none), args[3] the task's message, args[4] the model, args[5]
-- the API key ('': none), args[6] bytes admitted before and not used (given back), args[7] the job id, args[8..11]
-- the decode charge (take_decode's cost, share, now, lapse: read only with keys[6]), args[12] n, args[13..12 + n] the record's
-- fields and values, then admit()'s ADMISSION_ARGS when keys[8] is given.
-- Returns {'hit', document}, admit()'s refusal, {'decode_share', held} or {'created', admit()'s figures (0s when
-- admitted before)}.
local TAKE_IN_KEYS, TAKE_IN_ARGS = 7, 12

local function no_job(keys)
  if keys[5] ~= '' then redis.call('DEL', keys[5]) end
end

redis.register_function('take_in', function(keys, args)
  if keys[1] ~= '' then
    local document = redis.call('GET', keys[1])
    if document then
      no_job(keys)
      return {'hit', document}
    end
  end
  local n = tonumber(args[TAKE_IN_ARGS])
  local verdict = {'created', 0, 0, 0, 0}
  local admitted = 0
  if #keys > TAKE_IN_KEYS then
    verdict = admit(keys, args, TAKE_IN_KEYS + 1, #keys, TAKE_IN_ARGS + n + 1)
    if verdict[1] ~= 'admitted' then
      no_job(keys)
      return verdict
    end
    admitted = tonumber(args[TAKE_IN_ARGS + n + 2])
    verdict[1] = 'created'
  end
  if keys[6] ~= '' then
    local charge = take_decode(keys[6], args[5], args[7], args[8], args[9], args[10], args[11])
    if charge[1] == 0 then
      release_waiting(keys[7], args[4], admitted, args[5])
      no_job(keys)
      return {'decode_share', charge[2]}
    end
  end
  release_waiting(keys[7], args[4], args[6], args[5])
  redis.call('HSET', keys[2], unpack(args, TAKE_IN_ARGS + 1, TAKE_IN_ARGS + n))
  redis.call('EXPIRE', keys[2], args[1])
  if args[2] ~= '' then redis.call('ZADD', keys[3], args[2], args[7]) end
  if keys[4] ~= '' then redis.call('LPUSH', keys[4], args[3]) end
  return verdict
end)
