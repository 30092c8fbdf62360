
-- The step `lookup_or_admit` (JobIntake.answer_or_admit): a result-cache lookup (contract.cache) and, on a miss,
-- the job's admission (admit, admission.lua), in one round trip. On a hit: the cached document, nothing written
-- (the hit's own step follows). keys[1] the entry, keys[2..] admit()'s keys; args admit()'s ADMISSION_ARGS.
-- Returns {'hit', document} or admit()'s verdict.
redis.register_function('lookup_or_admit', function(keys, args)
  local document = redis.call('GET', keys[1])
  if document then return {'hit', document} end
  return admit(keys, args, 2, #keys, 1)
end)
