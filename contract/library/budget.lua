
-- Bytes given back (contract.admission.budget): HINCRBY, never below zero. release_waiting gives one model's bytes back, and
-- the key's (`owner`: the job's API key; nil or '' for a frame or a job without one); release_each gives back
-- {model: bytes} (a step that ended many jobs) and release_owners {owner: {model: bytes}}: one HINCRBY a model (and
-- key), not one a job. key_waiting names a key's hash as Keys.key_waiting_bytes does (KEY_WAITING_SEPARATOR).
local KEY_WAITING_SEPARATOR = ':'

local function key_waiting(waiting, owner) return waiting .. KEY_WAITING_SEPARATOR .. owner end

-- A count passed to redis.call goes as text formatted here as an integer: a Lua number there is formatted as
-- `%.17g`, a costly conversion each time (docs/benchmarks/2026-12-07-plane-cuts.md, round four).
local function release_field(waiting, field, bytes)
  if bytes > 0 and field ~= '' and redis.call('HINCRBY', waiting, field, string.format('%d', -bytes)) < 0 then
    redis.call('HSET', waiting, field, '0')
  end
end

local function release_waiting(waiting, model, bytes, owner)
  bytes = bytes and bytes + 0 or 0   -- an argument, a number or a record's `bytes` (head.lua: numbers)
  release_field(waiting, model or '', bytes)
  if owner and owner ~= '' then release_field(key_waiting(waiting, owner), model or '', bytes) end
end

local function release_each(waiting, by_model)
  for model, bytes in pairs(by_model) do release_field(waiting, model, bytes) end
end

local function release_owners(waiting, by_owner)
  for owner, by_model in pairs(by_owner) do release_each(key_waiting(waiting, owner), by_model) end
end
