-- Expiry's rule inside a step (contract.jobs.expiry says who may expire a job, and when; this is its library side).
-- The literals are contract's (contract.jobs.expiry's LATE_ERROR, jobs.record's statuses: a test holds them together).
local LATE_ERROR = '{"code":"deadline","message":"expired: its answer came after the deadline"}'
local SUCCEEDED, EXPIRED = 'succeeded', 'expired'

-- contract.jobs.expiry's `is_late` inside a step: `now` is an argument the caller read from the service's clock;
-- `deadline` a number, or nil or false (a record without one: HMGET's nil is false in Lua).
local function deadline_passed(deadline, now)
  return deadline and now + 0 > deadline
end

-- The fields written, from fields[first..last] (field, value, ...): an answer that came after the job's deadline ends
-- it `expired` instead, without its result. Returns the fields to write (nil: fields[first..last] as they are, no
-- table made of them) and the status and result they end the job with, and for an answer in time its finished_at
-- as written and as a number (read once: the cache's books take both).
local function late_as_expired(deadline, fields, first, last)
  local status, finished, result
  for i = first, last, 2 do
    if fields[i] == 'status' then status = i elseif fields[i] == 'finished_at' then finished = i
    elseif fields[i] == 'result' then result = i end
  end
  local ends_as = status and fields[status + 1]
  local at = ends_as == SUCCEEDED and finished and fields[finished + 1] + 0
  if not at or not deadline_passed(deadline, at) then
    return nil, ends_as, result and fields[result + 1], finished and fields[finished + 1], at or nil
  end
  local kept = {}
  for i = first, last, 2 do
    if i ~= result then
      kept[#kept + 1] = fields[i]
      kept[#kept + 1] = (i == status) and EXPIRED or fields[i + 1]
    end
  end
  kept[#kept + 1] = 'error'
  kept[#kept + 1] = LATE_ERROR
  return kept, EXPIRED, nil, nil
end
