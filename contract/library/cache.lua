
-- The result cache (contract.cache), written by the step that ends a job `succeeded` with a `cache_key`: SET NX (the
-- first answer of an image stays); a digest whose entry expired but whose charge remains is charged again only
-- once. Then the entries unused past their TTL lose their LRU member, size field and charge: STALE_PER_ENTRY of them
-- with every entry stored, all of them (64 a step) while over budget; then, while still over it, the least
-- recently used. ENTRY_OVERHEAD and STALE_PER_ENTRY are contract.cache's (a test holds them together).
local ENTRY_OVERHEAD, STALE_PER_ENTRY = 200, 2

-- The cache's names from args[i..i + 2] (CacheLimits.finish_names).
local function cache_names(args, i)
  -- the TTL as given too: a Lua number passed to redis.call is formatted anew each time (`%.17g`)
  return {prefix = args[i], max = args[i + 1] + 0, ttl = args[i + 2] + 0, ttl_text = args[i + 2]}
end

local function forget_digest(cache, digest)
  local charged = tonumber(redis.call('HGET', cache.prefix .. 'sizes', digest) or '0')
  redis.call('DEL', cache.prefix .. 'e:' .. digest)
  redis.call('HDEL', cache.prefix .. 'sizes', digest)
  redis.call('ZREM', cache.prefix .. 'lru', digest)
  if charged > 0 then redis.call('DECRBY', cache.prefix .. 'bytes', charged) end
end

-- The entries a step's jobs leave (each that ended `succeeded` now with a `cache_key`): {digest, result, moment, job
-- id, the moment as a number (nil: read here)}. The moment goes to ZADD as written, not as a number formatted again.
-- Stored one SET NX each; their bookkeeping (the stale charges read, the sizes, the LRU members, the total, the
-- sweep of stale entries) in one call each for all of them: each call inside a script has a fixed cost to Redis
-- (docs/benchmarks/2026-12-06-control-plane.md), so a batch's entries share their calls.
local function remember_all(cache, entries)
  if cache.max <= 0 or #entries == 0 then return end
  local digests, sizes, charges, members, newest = {}, {}, {}, {}, 0
  for e = 1, #entries do   -- not ipairs: its iterator is a C call an entry
    local entry = entries[e]
    local digest, result, moment = entry[1], entry[2], entry[3]
    local now = entry[5] or tonumber(moment)
    if not now then now, moment = 0, '0' end
    local charged = #result + ENTRY_OVERHEAD
    local stored = charged <= cache.max
      and redis.call('SET', cache.prefix .. 'e:' .. digest, result, 'EX', cache.ttl_text, 'NX')
    if stored then
      digests[#digests + 1] = digest
      charges[#charges + 1] = charged
      sizes[#sizes + 1] = digest
      sizes[#sizes + 1] = string.format('%d', charged)   -- as an integer: redis.call would format it as `%.17g`
      members[#members + 1] = moment
      members[#members + 1] = digest
      if now > newest then newest = now end
    end
  end
  if #digests == 0 then return end
  local stale = redis.call('HMGET', cache.prefix .. 'sizes', unpack(digests))
  local added = 0
  for i = 1, #digests do added = added + charges[i] - (stale[i] or 0) end   -- sizes written as integers
  redis.call('HSET', cache.prefix .. 'sizes', unpack(sizes))
  redis.call('ZADD', cache.prefix .. 'lru', unpack(members))
  local total = redis.call('INCRBY', cache.prefix .. 'bytes', string.format('%d', added))
  local expired = redis.call('ZRANGEBYSCORE', cache.prefix .. 'lru', '-inf', newest - cache.ttl, 'LIMIT', '0',
                             string.format('%d', total > cache.max and 64 or STALE_PER_ENTRY * #digests))
  for _, old in ipairs(expired) do
    forget_digest(cache, old)
  end
  if #expired > 0 then total = tonumber(redis.call('GET', cache.prefix .. 'bytes') or '0') end
  if total <= cache.max then return end
  while total > cache.max do
    local oldest = redis.call('ZRANGE', cache.prefix .. 'lru', 0, 0)[1]
    if not oldest then
      redis.call('SET', cache.prefix .. 'bytes', 0)   -- nothing left to charge: the count had drifted
      return
    end
    forget_digest(cache, oldest)
    total = tonumber(redis.call('GET', cache.prefix .. 'bytes') or '0')
  end
end
