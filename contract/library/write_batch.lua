
-- The step `write_batch`, the GPU worker's batch write (gpu_worker.finish.Finisher): ends every job of the batch,
-- acknowledges every frame it took and updates the worker's counters, atomically.
-- keys[1] the callback outbox, keys[2] the processing list ('' with bulk shards: the source acks there after this),
-- keys[3] the counters hash, keys[4] the worker's epoch, keys[5] the frames-waiting hash (bulk shards), keys[6..]
-- job hashes; args[1..FINISH_NAMES] JobEnding.finish_names(), then, at N = FINISH_NAMES: args[N + 1] frames to
-- acknowledge (the oldest in hand), args[N + 2] their bytes, args[N + 3] their model, args[N + 4] the count of
-- counter field and value arguments, args[N + 5] the epoch the batch was taken in ('': unfenced), then the
-- counters, then the jobs' (JobEnding.finish_arguments). Returns the jobs ended, or -1 (nothing written) when the
-- epoch is no longer the worker's.
redis.register_function('write_batch', function(keys, args)
  local N = FINISH_NAMES
  if args[N + 5] ~= '' and redis.call('GET', keys[4]) ~= args[N + 5] then
    return -1   -- this worker was presumed dead: its frames are another's now (gpu_worker.liveness)
  end
  local names = finish_names(keys[1], args, 1)
  local acked, acked_bytes, model, counters = tonumber(args[N + 1]), args[N + 2], args[N + 3], tonumber(args[N + 4])
  if acked > 0 then
    if keys[2] ~= '' then
      ack_frames(keys[2], acked)
    elseif redis.call('HINCRBY', keys[5], model, -acked) < 0 then   -- on bulk shards: acked after, counted out here
      redis.call('HSET', keys[5], model, 0)
    end
    release_waiting(names.waiting, model, acked_bytes)   -- the frames leave Redis: their bytes wait no more
  end
  if counters > 0 then
    redis.call('HSET', keys[3], unpack(args, N + 6, N + 5 + counters))
  end
  return finish_jobs(keys, args, names, 6, N + 6 + counters)
end)
