"""What every process sets up for itself, the same way: its log lines, its malloc, its release.

- `logs`: one JSON log line format for every process (its settings read from the environment first).
- `memory`: malloc's thresholds, so that freed image buffers stay in the process.
- `release`: this checkout's release, carried by every frame.
"""
