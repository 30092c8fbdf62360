"""What the workers say about themselves, and how many of them the backlog wants.

- `heartbeat`: what a GPU worker says about itself, typed for its writer (the GPU worker) and its readers (the API).
- `scaling`: the backlog as the product sees it (queued, held, frames) and the CPU worker processes it wants:
  /v1/stats' `scaling`, the GPU worker's gauges, the autoscalers' signal. Its settings are contract.settings.scaling.
"""
