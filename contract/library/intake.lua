
-- The step `lookup_or_admit` (JobIntake.answer_or_admit): a result-cache lookup (contract.cache) and, on a miss,
-- the job's admission (admit, admission.lua), in one round trip. On a hit: the cached document, nothing written
-- (the hit's own step follows). keys[1] the entry, keys[2..] admit()'s keys; args admit()'s ADMISSION_ARGS.
-- Returns {'hit', document} or admit()'s verdict.
redis.register_function('lookup_or_admit', function(keys, args)
  local document = redis.call('GET', keys[1])
  if document then return {'hit', document} end
  return admit(keys, args, 2, #keys, 1)
end)

-- The step `take_in` (JobIntake.take_in): the last command of a new job's transaction, after the job's own writes (its
-- record, its TTL, its deadline entry, its Celery message: plain commands, which cost Redis less than the same writes
-- from Lua), so that a job's whole intake is one round trip. It judges the job they made: the result cache's lookup (a
-- hit: its document), the key's answer bucket (in debt: refused), the admission (admit: refused), the decode charge
-- (refused: the bytes just reserved given back). Whatever refuses or answers it takes the job's writes back, and its
-- upload where it lies here: nothing of it is kept. keys[1] the cache entry ('': no lookup), keys[2] the record,
-- keys[3] the deadline index, keys[4] the task's list ('': no task), keys[5] the upload stored here in the transaction
-- ('': on a bulk shard), keys[6] the decode charges ('': no charge), keys[7] the waiting-bytes hash, keys[8] the API
-- key's answer debt marker (Keys.answer_debt; '': no key or no bound), keys[9..] admit()'s (none: admitted before the
-- body was read). args[1] the model, args[2] the API key ('': none), args[3] bytes admitted before and not used (given
-- back), args[4] the job id, then admit()'s ADMISSION_ARGS when keys[8] is given, then the decode charge's four
-- (take_decode's cost, share, now, lapse) when keys[6] is, then, last, the task's message when it may no longer be its
-- list's head (a call after the transaction: the library was missing in it): absent when it is. What a job does not use
-- is not sent: each argument costs the step a fixed amount of work (contract/jobs/intake.py). Returns {'hit',
-- document}, {'answer_debt', ms until the key's bucket is out of debt}, admit()'s refusal, {'decode_share', held} or
-- {'created', admit()'s figures (0s when admitted before)}. `take_in` is the same step as library version 6 called
-- it, without keys[8] (admit()'s from keys[8]) and without the debt's check: an API of that version calls it beside a
-- newer one's `take_in_bounded`.
local TAKE_IN_KEYS, TAKE_IN_ARGS = 8, 4

local function not_taken_in(keys, args, message)
  if keys[5] ~= '' then redis.call('DEL', keys[2], keys[5]) else redis.call('DEL', keys[2]) end
  redis.call('ZREM', keys[3], args[4])
  if keys[4] == '' then return end
  if message == nil then redis.call('LPOP', keys[4]) else redis.call('LREM', keys[4], 1, message) end
end

local function take_in(keys, args, fixed)
  local admitting = #keys > fixed
  local c = TAKE_IN_ARGS + (admitting and 8 or 0)   -- the decode charge's first argument, if any
  local message = args[c + (keys[6] ~= '' and 5 or 1)]
  if keys[1] ~= '' then
    local document = redis.call('GET', keys[1])
    if document then
      not_taken_in(keys, args, message)
      return {'hit', document}
    end
  end
  if fixed == TAKE_IN_KEYS and keys[8] ~= '' then   -- its answers overdrew the key's bucket (debit_answers): nothing
    -- more until the refill has paid it
    local debt = redis.call('PTTL', keys[8])
    if debt > 0 then
      not_taken_in(keys, args, message)
      return {'answer_debt', debt}
    end
  end
  local verdict = {'created', 0, 0, 0, 0}
  local admitted = 0
  if admitting then
    local k = fixed + 1
    local pending = 0   -- the job's own message, on its key's queue already: not counted against it
    if keys[4] ~= '' and keys[4] == keys[k + 3] and (message == nil or redis.call('LPOS', keys[4], message)) then
      pending = 1
    end
    verdict = admit(keys, args, k, #keys, TAKE_IN_ARGS + 1, pending)
    if verdict[1] ~= 'admitted' then
      not_taken_in(keys, args, message)
      return verdict
    end
    admitted = args[TAKE_IN_ARGS + 2] + 0
    verdict[1] = 'created'
  end
  if keys[6] ~= '' then
    local charge = take_decode(keys[6], args[2], args[4], args[c + 1], args[c + 2], args[c + 3], args[c + 4])
    if charge[1] == 0 then
      release_waiting(keys[7], args[1], admitted, args[2])
      not_taken_in(keys, args, message)
      return {'decode_share', charge[2]}
    end
  end
  if args[3] ~= '0' then release_waiting(keys[7], args[1], args[3], args[2]) end
  return verdict
end

redis.register_function('take_in', function(keys, args) return take_in(keys, args, TAKE_IN_KEYS - 1) end)
redis.register_function('take_in_bounded', function(keys, args) return take_in(keys, args, TAKE_IN_KEYS) end)
-- The step `take_in_job`: take_in_bounded answering a job made with 1 alone, not {'created', figures} (the API reads
-- no figure of an admission it passed): a table reply costs Redis more (each table is searched
-- for `err`, `ok` and the RESP3 types, then each element converted). Its refusals and hits answer as take_in's.
redis.register_function('take_in_job', function(keys, args)
  local verdict = take_in(keys, args, TAKE_IN_KEYS)
  if verdict[1] == 'created' then return 1 end
  return verdict
end)
