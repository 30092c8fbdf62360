"""The contract the API, the CPU workers and the GPU worker share, a package a concept, lowest first: a package
imports only those above it in this list (tests/test_layout.py holds the order, `CONTRACT_FLOORS`).

- `settings`: every setting: the sections, their types and defaults, the checks between them, and how they are read
  (`config`: files, overlays, the one environment rule); the models served and their routing, the cells. Nothing
  here talks to Redis.
- `runtime`: what every process sets up for itself: its log lines (`logs`), its malloc (`memory`), its `release`.
- `library`: every Redis step of a job's life: one function library, a `.lua` file a step, its loader and version.
- `redis`: how every process reaches Redis (`connection`), what a 202 waits for (`replication`), every key
  (`keys`), the one clock (`clock`), payload replies read without copies (`replies`), the bulk shards (`shards`).
- `admission`: what the API checks and counts before it takes a job: the accepted image types (`media`), the
  budgets (`budget`), the rate limit (`token_bucket`), the decode charge (`decode_share`).
- `cache`: the result cache; `cache_plane` its own Redis when `cache.redis_url` is set.
- `jobs`: a job's record and its moves (`record`, `ending`, `intake`, `hits`, `handoff`, `ids`, `backlog`), its
  Celery messages (`task_messages`), its time bill (`timebill`), its deadline (`deadlines`, `expiry`).
- `workers`: what a GPU worker says about itself (`heartbeat`), and the CPU workers the backlog wants (`scaling`).
- `frames`: the binary frame, its header in Python and in Lua; `frame_push`: the frame list's way in (the CPU
  worker's push); `frame_source`: its way out (pop, the one ack, give back, requeue); `frame_shards` and
  `frame_shard_source`: the same over bulk shards.
- `callbacks`: which callback URLs may be called (checked at submit and at delivery), which secret signs a job's
  callbacks (`callback_signature`: what the signature covers), the address blocks never called
  (`special_addresses`).
- `documents`: the public JSON documents of jobs (job, callback, submit options, problems) as pydantic models;
  `status_documents`: the service's own (health, readiness, models, stats).
"""
