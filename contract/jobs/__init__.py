"""Jobs: a job's record and its moves, by who makes them, and what a job carries through them.

- `record`: a job's states (`JobStatus`), its hash (`JobRecord`), the encoding of its fields, and `JobStore`
  (read, delete, move along).
- `ending`: how jobs end (the library's `finish_jobs`, which every step that ends jobs calls) and `JobEnding`: finish,
  fail, expire, the overdue sweep, a callback queued again.
- `intake`: the API's `JobIntake`: a job stored with its upload and task, withdrawn when too few replicas hold it,
  or answered from the result cache with the admission in the same step.
- `hits`: a cache hit's job, stored ended already (the API's).
- `handoff`: the CPU workers' `JobHandOff`: the claim. (The frame's push is the frame list's:
  contract.frames.frame_push.)
- `ids`: job ids a client can check (the API makes and checks them).
- `backlog`: the jobs and frames waiting per model (`queue_depths`).
- `task_messages`: the Celery tasks' names and queues, and the preprocess message the API pushes with the job.
- `timebill`: the stages of a request's life, the stamps that bound them, a bill and the summaries of many.
- `deadlines`: what a deadline is and how every stage judges it; `expiry`: who may end a job `expired`, and when.

Their Redis steps are functions of one library (contract.library); a process holds the class of its role (a class
ends jobs as its base). `intake` and `hits` are the API's alone and `handoff` the CPU workers' alone, yet live here:
each is the Python side of a library step (library/intake.lua, hits.lua, handoff.lua) whose argument positions and
replies stay beside the record's encoding and the other steps'. `ids` is the API's too: the bench and the tests
make ids as it does, and a record's `lost_at` is judged by what an id says.
"""
