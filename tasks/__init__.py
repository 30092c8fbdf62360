"""The CPU and callback workers (Celery), in three parts, and the two modules Celery is started on.

- `hop/`: the Celery hop, the plumbing every worker runs whatever its tasks: the app (celery_app), how a message is
  taken, held, acked and given back (broker, given_back, lost_deliveries, recovery), the consumer's steps (full_lists,
  event_batching, job_sweeps with shard_watch) and the autoscaler. It imports neither of the other two.
- `decoding/`: one job's CPU stage (preprocess: claim, decode, letterbox, push the frame) and the decode it runs
  (imaging; structure, png_text, peak_memory and bmp_rle judge and bound what an image costs before Pillow pays it).
- `callbacks/`: a job's callback delivered (delivery), its POST (http_client), the outbox's relay and each tenant's
  slots.

`worker.py` (`celery -A tasks.worker`) wires the three into one app: its two tasks, under the names of
contract.jobs.task_messages, and the steps; `flower.py` (`celery -A tasks.flower`) is that app for Flower.
"""
