
-- The step `lookup_or_admit` (JobIntake.answer_or_admit): a result-cache lookup (contract.cache) and, on a miss,
-- the job's admission (admit, admission.lua), in one round trip. On a hit: the cached document, nothing written
-- (the hit's own step follows). keys[1] the entry, keys[2..] admit()'s keys; args admit()'s ADMISSION_ARGS.
-- Returns {'hit', document} or admit()'s verdict.
redis.register_function('lookup_or_admit', function(keys, args)
  local document = redis.call('GET', keys[1])
  if document then return {'hit', document} end
  return admit(keys, args, 2, #keys, 1)
end)

-- The step `take_in` (JobIntake.take_in): the last command of a new job's transaction, after the job's own writes
-- (its record, its TTL, its deadline entry, its Celery message: plain commands, which cost Redis less than the same
-- writes from Lua), so that a job's whole intake is one round trip. It judges the job they made: the result cache's
-- lookup (a hit: its document), the admission (admit: refused), the decode charge (refused: the bytes just reserved
-- given back). Whatever refuses or answers it takes the job's writes back, and its upload where it lies here: nothing
-- of it is kept. keys[1] the cache entry ('': no lookup), keys[2] the record, keys[3] the deadline index, keys[4] the
-- task's list ('': no task), keys[5] the upload stored here in the transaction ('': on a bulk shard), keys[6] the decode
-- charges ('': no charge), keys[7] the waiting-bytes hash, keys[8..] admit()'s (none: admitted before the body was
-- read). args[1] the model, args[2] the API key ('': none), args[3] bytes admitted before and not used (given back),
-- args[4] the job id, args[5] the task's message when it may no longer be its list's head (a call after the
-- transaction: the library was missing in it), else '', args[6..9] the decode charge (take_decode's cost, share,
-- now, lapse: read only with keys[6]), args[10..] admit()'s ADMISSION_ARGS when keys[8] is given.
-- Returns {'hit', document}, admit()'s refusal, {'decode_share', held} or {'created', admit()'s figures (0s when
-- admitted before)}.
local TAKE_IN_KEYS, TAKE_IN_ARGS = 7, 9

local function not_taken_in(keys, args)
  if keys[5] ~= '' then redis.call('DEL', keys[2], keys[5]) else redis.call('DEL', keys[2]) end
  redis.call('ZREM', keys[3], args[4])
  if keys[4] == '' then return end
  if args[5] == '' then redis.call('LPOP', keys[4]) else redis.call('LREM', keys[4], 1, args[5]) end
end

redis.register_function('take_in', function(keys, args)
  if keys[1] ~= '' then
    local document = redis.call('GET', keys[1])
    if document then
      not_taken_in(keys, args)
      return {'hit', document}
    end
  end
  local verdict = {'created', 0, 0, 0, 0}
  local admitted = 0
  if #keys > TAKE_IN_KEYS then
    local k = TAKE_IN_KEYS + 1
    local mine = 0   -- the job's own message, on its key's queue already: not counted against it
    if keys[4] ~= '' and keys[4] == keys[k + 3] and (args[5] == '' or redis.call('LPOS', keys[4], args[5])) then
      mine = 1
    end
    verdict = admit(keys, args, k, #keys, TAKE_IN_ARGS + 1, mine)
    if verdict[1] ~= 'admitted' then
      not_taken_in(keys, args)
      return verdict
    end
    admitted = tonumber(args[TAKE_IN_ARGS + 2])
    verdict[1] = 'created'
  end
  if keys[6] ~= '' then
    local charge = take_decode(keys[6], args[2], args[4], args[6], args[7], args[8], args[9])
    if charge[1] == 0 then
      release_waiting(keys[7], args[1], admitted, args[2])
      not_taken_in(keys, args)
      return {'decode_share', charge[2]}
    end
  end
  if args[3] ~= '0' then release_waiting(keys[7], args[1], args[3], args[2]) end
  return verdict
end)
