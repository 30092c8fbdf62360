"""The Celery hop: the app, a job's message between the API and a worker (taken, held, acked, given back), its
recovery when a worker dies or Redis fails over, and the steps and autoscaler every worker runs. Imports neither
tasks.decoding nor tasks.callbacks.delivery."""
