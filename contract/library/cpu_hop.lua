
-- The CPU hop's recoveries (tasks.broker, tasks.lost_deliveries).

-- The step `may_reap_cpu_worker` (tasks.broker.reap_dead_workers): keys[1] the worker's heartbeat, keys[2] the
-- reaping lock; args[1] the reaper, args[2] the lock's TTL (s). 1: the worker is dead and this reaper may give back
-- its messages; 0: it lives, or another reaper has it.
redis.register_function('may_reap_cpu_worker', function(keys, args)
  if redis.call('EXISTS', keys[1]) == 1 then return 0 end
  if redis.call('SET', keys[2], args[1], 'NX', 'EX', tonumber(args[2])) then return 1 end
  return 0
end)

-- The step `resend_task` (tasks.lost_deliveries): keys[1] the job hash, keys[2] its queue's list; args[1] the
-- message, args[2] the most times a job is sent its task again, args[3] its `resent` count as this round read it.
-- The message goes to the end BRPOP takes from (the front), only while the job is still queued, has not been sent it
-- that often, and nobody sent it again since this round looked (a round that outlived its lock, beside the next one,
-- must not send a second copy): 1 sent, 0 not.
redis.register_function('resend_task', function(keys, args)
  if redis.call('HGET', keys[1], 'status') ~= QUEUED then return 0 end
  local resent = tonumber(redis.call('HGET', keys[1], 'resent') or '0')
  if resent ~= tonumber(args[3]) or resent >= tonumber(args[2]) then return 0 end
  redis.call('RPUSH', keys[2], args[1])
  redis.call('HINCRBY', keys[1], 'resent', 1)
  return 1
end)

-- The JSON string that follows the key `name` in a message from `from` on, its quotes included, and where it ends;
-- nil when it is not there as `"name": "..."` with no escape inside. Read as text, not decoded: decoding a whole
-- message (cjson) cost the take more than the round trips it saves (docs/benchmarks/2026-12-07-cpu-hop.md).
local function json_string_after(item, name, from)
  local _, last = string.find(item, '"' .. name .. '": "', from, true)
  if not last then return nil end
  local close = string.find(item, '"', last + 1, true)
  if not close then return nil end
  local value = string.sub(item, last, close)
  if string.find(value, '\\', 1, true) then return nil end
  return value, close
end

-- A message's delivery tag, exchange and routing key (the last two as JSON strings), by their keys' text (kombu's and
-- contract.task_messages' JSON: `"key": "value"`), else by decoding it; nil when it has none.
local function delivery_of(item)
  -- A message's properties come last (kombu's and the API's): looked for in its tail first, then in the whole.
  local from = #item > 640 and #item - 512 or 1
  local tag = json_string_after(item, 'delivery_tag', from) or json_string_after(item, 'delivery_tag', 1)
  local _, info = string.find(item, '"delivery_info": {', from, true)
  if not info and from > 1 then _, info = string.find(item, '"delivery_info": {', 1, true) end
  if tag and info then
    local info_end = string.find(item, '}', info, true)
    local exchange, exchange_end = json_string_after(item, 'exchange', info)
    local routing_key, routing_end = json_string_after(item, 'routing_key', info)
    if exchange and routing_key and exchange_end < info_end and routing_end < info_end then
      return string.sub(tag, 2, -2), exchange, routing_key
    end
  end
  local ok, message = pcall(cjson.decode, item)
  if not ok or type(message) ~= 'table' or type(message['properties']) ~= 'table' then return nil end
  local delivery = message['properties']['delivery_info']
  if type(message['properties']['delivery_tag']) ~= 'string' or type(delivery) ~= 'table' then return nil end
  return message['properties']['delivery_tag'], cjson.encode(delivery['exchange'] or ''),
         cjson.encode(delivery['routing_key'] or '')
end

-- What `take_and_hold` records for a message it takes: the message as it lay on its queue, its exchange, its
-- routing key and when (tasks.broker's held format, the one HeldQoS.restore_held reads back). 0: not a message
-- kombu can read (no tag): left unheld, for the worker's own append (which cannot read it either) to refuse.
local function hold_taken(holds, item, now)
  local tag, exchange, routing_key = delivery_of(item)
  if not tag then return 0 end
  redis.call('HSET', holds, tag, '[' .. item .. ',' .. exchange .. ',' .. routing_key .. ',' .. now .. ']')
  return 1
end

-- The step `take_and_hold` (tasks.broker's Channel, the CPU hop under load): keys[1] the worker's holds, keys[2..]
-- its queues in the order it takes from them; args[1] now, args[2] the most messages to take, args[3..] the delivery
-- tags this worker acknowledged since its last take (their holds go: the acks ride on the take). Each message is
-- taken from the end BRPOP takes from and recorded as held in the same step, so no window lies between the pop and
-- the hold. Returns {queue key, message, 1 held | 0 not, ...}; empty: every queue was empty (the worker goes back
-- to BRPOP).
redis.register_function('take_and_hold', function(keys, args)
  if #args > 2 then redis.call('HDEL', keys[1], unpack(args, 3)) end
  local now, most, taken = tostring(tonumber(args[1])), tonumber(args[2]), {}
  for position = 2, #keys do
    while #taken < most * 3 do
      local item = redis.call('RPOP', keys[position])
      if not item then break end
      taken[#taken + 1] = keys[position]
      taken[#taken + 1] = item
      taken[#taken + 1] = hold_taken(keys[1], item, now)
    end
  end
  return taken
end)
