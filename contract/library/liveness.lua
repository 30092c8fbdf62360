
-- The step `gpu_beat` (the GPU worker's heartbeat, gpu_worker.heartbeat): keys[1] the worker's epoch, keys[2] its
-- heartbeat, keys[3] the registry, keys[4] its counters hash; args[1] its epoch, args[2] the heartbeat's text (''
-- withholds it: the loop stalled), args[3] its TTL (ms), args[4] the worker id, args[5] now, args[6..] the counters'
-- field, value, ... (gpu_worker.host_time.worker_counters: written here, once a beat, rather than by every batch
-- write). 0 when the epoch is not this life's any more (a reaper took its frames): nothing written; else 1.
redis.register_function('gpu_beat', function(keys, args)
  if redis.call('GET', keys[1]) ~= args[1] then return 0 end
  if args[2] ~= '' then
    redis.call('SET', keys[2], args[2], 'PX', tonumber(args[3]))
    redis.call('ZADD', keys[3], tonumber(args[5]), args[4])
  end
  if #args > 5 then redis.call('HSET', keys[4], unpack(args, 6)) end
  return 1
end)
