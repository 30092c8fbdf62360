
-- How jobs end, whoever ends them (contract.jobs.ending): the first terminal state wins; the upload and the deadline
-- entry go, the bytes are released (its API key's too), a callback enters the outbox, `job_events` is published,
-- and a job that succeeded in time with a `cache_key` leaves its result in the result cache; an answer after the
-- deadline ends it `expired` (deadlines.lua's late_as_expired). The literals below are contract's
-- (keys.UPLOAD_SUFFIX, jobs.ending's PENDING_CALLBACK: a test holds them together).
local UPLOAD_SUFFIX = ':upload'
local PENDING_CALLBACK = '{"status":"pending","attempts":0,"last_error":null}'
-- A job in these has no upload left: the push took it in the step that moved the job on (contract.frames.frame_push; over
-- bulk shards, a frame taken before that step ran finds the job over, and the step gives the upload's bytes back).
local PUSHED = {[QUEUED_GPU] = true, [RUNNING] = true}
-- Over bulk shards the upload lies on a shard and its marker is a field of the record (contract.redis.shards'
-- SHARDED_UPLOAD in UPLOAD_FIELD), cleared to '' by the HSET of the step that takes it; a record an older API
-- stored has a marker key instead (Keys.upload), as a record without shards has its upload there. take_upload: 1
-- when this step takes the upload (its bytes to give back), 0 when it was taken before or is gone; `marker` is
-- the field's value as the step read it.
local SHARDED_UPLOAD, UPLOAD_FIELD = '@shard', 'upload'
local function take_upload(marker, upload)
  if marker == SHARDED_UPLOAD then return 1 end
  if marker == '' then return 0 end
  return redis.call('DEL', upload)
end

-- A job claimed by a CPU worker counted itself in among its API key's (handoff.lua's claim): one that ends before
-- its frame was pushed counts itself out here (a pushed one's frame is counted out by the batch write that answers
-- it). The count's hash is named from the job's (Keys.job, Keys.key_frames: the literals are contract's); a
-- deployment that counts nothing pays this on a keyed job's end in the CPU stage only, and keeps no count.
local JOB_INFIX, KEY_FRAMES_INFIX = ':job:', ':key_frames:'
local function count_out_claimed(key, job_id, model)
  local owner = redis.call('HGET', key, 'owner')
  if not owner or owner == '' then return end
  local counts = string.sub(key, 1, #key - #job_id - #JOB_INFIX) .. KEY_FRAMES_INFIX .. (model or '')
  if redis.call('HINCRBY', counts, owner, '-1') <= 0 then redis.call('HDEL', counts, owner) end
end

-- The names finish_jobs needs, from the FINISH_NAMES arguments at args[i..i + 6] (JobEnding.finish_names): the
-- record TTL, the job-events channel, the deadline index, the waiting-bytes hash, then the cache's three.
local FINISH_NAMES = 7
local function finish_names(outbox, args, i)
  return {outbox = outbox, ttl = args[i] + 0, channel = args[i + 1], deadlines = args[i + 2],
          waiting = args[i + 3], cache = cache_names(args, i + 4)}
end

-- What of a record ending it reads, in one HMGET (not one read a field: every command inside a step is one more
-- for Redis's only thread, per job); and, only for a job not pushed yet (whose upload its end takes), what the
-- upload's return needs, in one more. A pushed job's (most ends: the GPU worker's) upload went with its push.
local READ_AT_END = {'status', 'deadline_at', 'cache_key', 'callback_url'}
local READ_BEFORE_PUSH = {'model', 'bytes', UPLOAD_FIELD}
local NOTHING_READ = {}

-- Ends each live job whose hash is in keys[first_key..], with its arguments from args[at..]: per job its id, the
-- count of field and value arguments, the fields and values (JobEnding.finish_arguments). A job with a
-- callback_url enters the outbox in the same atomic step that ends it; an answer written after the job's deadline
-- ends it `expired` instead. Returns how many jobs it ended, and the entries it left for the cache ({digest, result,
-- moment, job id, moment as a number} each: stored by remember_all here, or, with the cache on a Redis of its own,
-- by the caller there).
local function finish_jobs(keys, args, names, first_key, at)
  local ended, left, entries, called, released, by_owner = 0, {}, {}, {}, {}, {}
  for k = first_key, #keys do
    local key, job_id, count = keys[k], args[at], args[at + 1] + 0
    local was = redis.call('HMGET', key, READ_AT_END[1], READ_AT_END[2], READ_AT_END[3], READ_AT_END[4])   -- no unpack: a C call
    local status = was[1]
    if status and not TERMINAL[status] then
      local pushed = PUSHED[status]
      local before = pushed and NOTHING_READ or redis.call('HMGET', key, unpack(READ_BEFORE_PUSH))
      local model, upload_bytes, marker = before[1], before[2], before[3]
      if status == PREPROCESSING then count_out_claimed(key, job_id, model) end
      local first, last = at + 2, at + 1 + count
      local fields, ends_as, result, finished, moment = late_as_expired(was[2] and was[2] + 0, args, first, last)
      if not fields and not was[4] and marker ~= SHARDED_UPLOAD then   -- most ends: the caller's fields as sent
        redis.call('HSET', key, unpack(args, first, last))
      else
        fields = fields or {unpack(args, first, last)}
        if was[4] then   -- its callback enters the outbox (below), in the same write
          fields[#fields + 1] = 'callback'
          fields[#fields + 1] = PENDING_CALLBACK
          called[#called + 1] = job_id
        end
        if marker == SHARDED_UPLOAD then   -- its marker goes in the same HSET (a pushed job's: read as nil)
          fields[#fields + 1] = UPLOAD_FIELD
          fields[#fields + 1] = ''
        end
        redis.call('HSET', key, unpack(fields))
      end
      -- a record made with a deadline lives until jobs.ttl_s past it (JobIntake.create): no TTL to set again
      if not was[2] then redis.call('EXPIRE', key, names.ttl) end
      if ends_as == SUCCEEDED and was[3] and result then entries[#entries + 1] = {was[3], result, finished, job_id, moment} end
      -- whatever ended it, its upload goes with it (no DEL an image where the push took it)
      if not pushed and take_upload(marker, key .. UPLOAD_SUFFIX) == 1 then
        local bytes = tonumber(upload_bytes) or 0
        model = model or ''
        if bytes > 0 then released[model] = (released[model] or 0) + bytes end
        -- its API key's share of the budgets (contract.admission.budget), read only here: a job whose frame was pushed (a
        -- batch's) has no upload left, and its end reads no more than before
        local owner = bytes > 0 and redis.call('HGET', key, 'owner')
        if owner and owner ~= '' then
          local mine = by_owner[owner] or {}
          by_owner[owner], mine[model] = mine, (mine[model] or 0) + bytes
        end
      end
      left[#left + 1] = job_id
      ended = ended + 1
    end
    at = at + 2 + count
  end
  if #left > 0 then   -- one call each for all of them: a batch's ends wake long-polls with one message
    redis.call('ZREM', names.deadlines, unpack(left))
    redis.call('PUBLISH', names.channel, table.concat(left, ' '))
  end
  if #called > 0 then   -- the PUBLISH wakes the callback relays (its channel is named as the outbox; they read
    redis.call('RPUSH', names.outbox, unpack(called))   -- the outbox, not the message)
    redis.call('PUBLISH', names.outbox, table.concat(called, ' '))
  end
  release_each(names.waiting, released)
  release_owners(names.waiting, by_owner)
  remember_all(names.cache, entries)
  return ended, entries
end

-- The step `finish_jobs` (JobEnding.finish_many): keys[1] the callback outbox, keys[2..] job hashes;
-- args[1..FINISH_NAMES] JobEnding.finish_names(), then the jobs' (JobEnding.finish_arguments).
redis.register_function('finish_jobs', function(keys, args)
  local ended = finish_jobs(keys, args, finish_names(keys[1], args, 1), 2, FINISH_NAMES + 1)
  return ended
end)

-- The step `redeliver_callback` (JobEnding.redeliver_callback): an ended job's callback queued again from its first
-- attempt, unless one is on its way already: a second request answers with that one, so repeated requests cannot
-- queue the same job many times. On its way: `pending` (in the outbox, a relay's hands, Celery's queue or its tenant's held
-- list), `delivering`, or `retrying` once a relay has taken it from the scheduled set (while it waits there, it
-- moves to the outbox: still one). One on its way for longer than args[2] is taken for lost and queued again; one
-- delivered less than args[3] ago answers too. keys[1] the job hash, keys[2] the outbox, keys[3] the scheduled set,
-- keys[4] the dead set; args[1] the job id, args[4] now (the service's clock). Returns REDELIVER_QUEUED (1),
-- REDELIVER_IN_FLIGHT (2: nothing queued) or 0 (no such job, not ended, no callback).
redis.register_function('redeliver_callback', function(keys, args)
  local status = redis.call('HGET', keys[1], 'status')
  if not status or not TERMINAL[status] or redis.call('HEXISTS', keys[1], 'callback_url') == 0 then return 0 end
  local now = tonumber(args[4])
  local ok, state = pcall(cjson.decode, redis.call('HGET', keys[1], 'callback') or '')
  if not ok or type(state) ~= 'table' then state = {} end
  local since
  if state.status == 'pending' or state.status == 'delivering' then
    -- a redelivery's queued_at, an attempt's attempt_at, or the job's end (its first delivery)
    since = tonumber(state.queued_at) or tonumber(state.attempt_at)
      or tonumber(redis.call('HGET', keys[1], 'finished_at')) or now
  elseif state.status == 'retrying' and redis.call('ZREM', keys[3], args[1]) == 0 then
    since = tonumber(state.next_attempt_at) or now   -- a relay took it when it fell due
  end
  if since and now - since < tonumber(args[2]) then return 2 end
  -- delivered moments ago: that delivery is the answer (a receiver that lost it asks once, not hundreds of times)
  local delivered = state.status == 'delivered' and tonumber(state.delivered_at)
  if delivered and now - delivered < tonumber(args[3]) then return 2 end
  redis.call('HSET', keys[1], 'callback',
             '{"status":"pending","attempts":0,"last_error":null,"queued_at":' .. now .. '}')
  redis.call('ZREM', keys[3], args[1])
  redis.call('ZREM', keys[4], args[1])
  redis.call('RPUSH', keys[2], args[1])
  redis.call('PUBLISH', keys[2], args[1])
  return 1
end)
