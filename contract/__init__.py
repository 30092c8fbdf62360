"""The contract the API, the CPU workers and the GPU worker share.

- `settings`: every setting: the sections, their types and defaults, and the checks between them.
- `redis_settings`: the `redis` and `bulk` sections: how every process reaches Redis, and the bulk shards.
- `cells`: the `cells` setting, several control planes behind one API tier; `cell_layout`: each cell with the
  settings its processes run with.
- `sections`: what a settings section is (a frozen, validated dataclass) and `SettingsError`.
- `config`: how the settings are read: files, overlays, the one environment rule (`load_settings`).
- `keys`: every Redis key and channel.
- `jobs`: a job's record and its moves, by who makes them (a package: `record`, `ending`, `intake`, `handoff`,
  `backlog`).
- `frames`: the binary frame, its header in Python and in Lua; `frame_push`: the frame list's way in (the CPU
  worker's push); `frame_source`: its way out (pop, the one ack, give back, requeue); `frame_shards` and
  `frame_shard_source`: the same over bulk shards.
- `timebill`: the stages of a request's life, the stamps that bound them, a bill and the summaries of many.
- `documents`: the public JSON documents of jobs (job, callback, submit options, problems) as pydantic models;
  `status_documents`: the service's own (health, readiness, models, stats).
- `models`: the models served side by side (`ModelSpec`), and how a request's `model` is routed to a version.
- `model_files`: what a model file is, and the labels / input size it carries.
- `task_messages`: the Celery tasks' names and queues, and the preprocess message the API pushes itself.
- `budget`: the admission step: a model's backlog, and the bytes waiting in Redis against their budgets.
- `memory`: malloc's thresholds, so that freed image buffers stay in the process.
- `connection`: how each process opens Redis.
- `clock`: the service's one clock (the Redis primary's), every moment written or judged is read from it.
- `deadlines`: what a deadline is and how every stage judges it.
- `replication`: behind Sentinel, what a 202 waits for (every replica the majority sees up) and the readers' fence.
- `logs`: one JSON log line format for every process.
- `heartbeat`: what a GPU worker says about itself, typed for its writer and its readers.
- `callbacks`: which callback URLs may be called (checked at submit and at delivery), and which secret
  signs a job's callbacks.
- `check_secrets`: the deploy-time check that refuses weak secrets.
- `replies`: reading Redis replies (uploads, frames) without extra copies.
"""
