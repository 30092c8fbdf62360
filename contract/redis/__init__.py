"""How every process reaches Redis and names what lies there (the Redis steps' code is contract.library's).

- `connection`: how each process opens Redis (a plain server, the primary the Sentinels name, a bulk shard), bounded
  by the `redis` section's timeout.
- `replication`: what a 202 waits for (the write and its WAIT; behind Sentinel every replica the majority sees up)
  and the readers' fence. The API alone writes jobs, but contract.jobs.intake runs it: it stays beside the connection
  whose settings it reads.
- `keys`: every Redis key and channel.
- `clock`: the service's one clock (the Redis primary's): every moment written or judged is read from it.
- `replies`: reading Redis replies that carry payloads (uploads, frames) without extra copies.
- `shards`: the bulk shards, where a job's upload and frame lie.
"""
