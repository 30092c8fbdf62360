
-- The step `claim` (contract.jobs.handoff, a CPU worker's claim): in the same round trip as a plain GET of the
-- upload and a plain HMGET of the record's CLAIM_FIELDS (the upload and the fields stay out of Lua: copied in and
-- out of its memory, they cost Redis far more than a plain read). A claimed job's API key comes back with its
-- jobs of the model claimed, waiting or in flight before this one (Keys.key_frames): the push chooses the end of
-- the list from it. The first claim counts the job in, one HINCRBY whose reply less one is the count before; the
-- push counts nothing, the batch write counts the frame out, and a claimed job that ends before its frame was
-- pushed counts itself out (ending.lua's count_out_claimed). A later claim (its task delivered again) finds the job
-- counted: it reads the count. The count's TTL (KEY_FRAMES_TTL_S, contract.frames.frame_push's) renewed when a
-- key's first job comes. keys[1] the job hash; args[1] now, args[2] the claim (a token of this attempt, which its
-- push must show), args[3] Keys.key_frames_prefix ('': not counted). Returns {'claimed', frames} (now
-- preprocessing; frames -1 for a job without a key, or not counted), 'missing', 'over' (past this stage or ended),
-- 'late' (deadline passed, unchanged: the caller ends it). CPU_STARTED_AT is contract.jobs.timebill's.
-- The step `claim_job` is the same claim answering a claimed job with its frames alone, an integer: a table reply
-- costs Redis more (each table is searched for `err`, `ok` and the RESP3 types; plane-cuts.md, round four).
-- `claim`, as CPU workers of library version 9 call it, answers as before.
local CPU_STARTED_AT = 'cpu_started_at'
-- as text, as the counts below: a Lua number passed to redis.call is formatted anew (`%.17g`) at each call
local KEY_FRAMES_TTL_S = '300'

-- claim(): a verdict string, or the claimed job's frames (a number).
local function claim(keys, args)
  local was = redis.call('HMGET', keys[1], 'status', 'deadline_at', 'owner', 'model')
  local status, owner = was[1], was[3]
  if not status then return 'missing' end
  if status ~= QUEUED and status ~= PREPROCESSING then return 'over' end
  if deadline_passed(was[2] and was[2] + 0, args[1]) then return 'late' end
  redis.call('HSET', keys[1], 'status', PREPROCESSING, CPU_STARTED_AT, args[1], 'updated_at', args[1],
             'claim', args[2])
  if args[3] == '' or not owner or owner == '' then return -1 end
  local counts = args[3] .. (was[4] or '')
  if status == PREPROCESSING then   -- counted by the claim before
    return math.max(0, (tonumber(redis.call('HGET', counts, owner)) or 0) - 1)
  end
  local count = redis.call('HINCRBY', counts, owner, '1')
  if count == 1 then redis.call('EXPIRE', counts, KEY_FRAMES_TTL_S) end
  return count - 1
end

redis.register_function('claim_job', claim)
redis.register_function('claim', function(keys, args)
  local verdict = claim(keys, args)
  if type(verdict) == 'number' then return {'claimed', verdict} end
  return verdict
end)
