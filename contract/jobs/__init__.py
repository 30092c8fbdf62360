"""Jobs: a job's record and its moves, by who makes them.

- `record`: a job's states (`JobStatus`), its hash (`JobRecord`), the encoding of its fields, and `JobStore`
  (read, delete, move along).
- `ending`: how jobs end (the library's `finish_jobs`, which every step that ends jobs calls) and `JobEnding`: finish,
  fail, expire, the overdue sweep, a callback queued again.
- `intake`: the API's `JobIntake`: a job stored with its upload and task, withdrawn when too few replicas hold it,
  or answered from the result cache with the admission in the same step.
- `handoff`: the CPU workers' `JobHandOff`: the claim. (The frame's push is the frame list's: contract.frame_push.)
- `backlog`: the jobs and frames waiting per model (`queue_depths`).

Their Redis steps are functions of one library (contract.library); a process holds the class of its role (a class
ends jobs as its base).
"""
