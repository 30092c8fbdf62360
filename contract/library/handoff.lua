
-- The step `claim` (contract.jobs.handoff, a CPU worker's claim): in the same round trip as a plain GET of the
-- upload and a plain HMGET of the record's CLAIM_FIELDS (the upload and the fields stay out of Lua: copied in and
-- out of its memory, they cost Redis far more than a plain read). A claimed job's API key comes back with its
-- frames of the model waiting or in flight (Keys.key_frames): the push chooses the end of the list from it.
-- keys[1] the job hash; args[1] now, args[2] the claim (a token of this attempt, which its push must show), args[3]
-- Keys.key_frames_prefix ('': not counted). Returns {'claimed', frames} (now preprocessing; frames -1 for a job
-- without a key, or not counted), 'missing', 'over' (past this stage or ended), 'late' (deadline passed,
-- unchanged: the caller ends it). CPU_STARTED_AT is contract.jobs.timebill's.
local CPU_STARTED_AT = 'cpu_started_at'

redis.register_function('claim', function(keys, args)
  local was = redis.call('HMGET', keys[1], 'status', 'deadline_at', 'owner', 'model')
  local status, owner = was[1], was[3]
  if not status then return 'missing' end
  if status ~= QUEUED and status ~= PREPROCESSING then return 'over' end
  if deadline_passed(tonumber(was[2]), args[1]) then return 'late' end
  redis.call('HSET', keys[1], 'status', PREPROCESSING, CPU_STARTED_AT, args[1], 'updated_at', args[1],
             'claim', args[2])
  if args[3] == '' or not owner or owner == '' then return {'claimed', -1} end
  return {'claimed', tonumber(redis.call('HGET', args[3] .. (was[4] or ''), owner)) or 0}
end)
