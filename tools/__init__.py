"""The commands around the product, not in it: each a `python -m tools.<name>`, none imported by app/, tasks/ or
gpu_worker/.

- `make run`'s supervisor: procfile.py (the Procfile's processes together), cells.py (`CELLS=N`), ports.py (every
  port free first), run_settings.py (what the shell needs of the settings), terminal.py (Ctrl-C and the terminal's
  foreground; terminal_session.py runs a command on a terminal of its own, for the checks).
- Redis on one machine: redis_ha.py (a primary, two replicas and three Sentinels, for failover), redis_config.py
  (configs/redis.conf as redis-server's options), restore.py (a backup put back where Redis loads it).
- Kubernetes: kubernetes.py renders the manifests (kubernetes_cells.py: as N cells), kubernetes_check.py validates
  them offline (against kubernetes_schemas/).
- Models: export_pt2.py (a detector as a torch.export program and its spec); gpu_image.py (what the GPU smoke test
  needs on its machine).
- The newcomer check: newcomer_check.py (the path a newcomer takes, run for real in CI; newcomer_mistakes.py: what
  they trip on).
- Releases: releases.py (RELEASES, and the tags made from it).
"""
