
-- The step `gpu_beat` (the GPU worker's heartbeat, gpu_worker.liveness): keys[1] the worker's epoch, keys[2] its
-- heartbeat, keys[3] the registry; args[1] its epoch, args[2] the heartbeat's text ('' withholds it: the loop
-- stalled), args[3] its TTL (ms), args[4] the worker id, args[5] now. 0 when the epoch is not this life's any more
-- (a reaper took its frames), else 1.
redis.register_function('gpu_beat', function(keys, args)
  if redis.call('GET', keys[1]) ~= args[1] then return 0 end
  if args[2] ~= '' then
    redis.call('SET', keys[2], args[2], 'PX', tonumber(args[3]))
    redis.call('ZADD', keys[3], tonumber(args[5]), args[4])
  end
  return 1
end)
