"""The bench's subcommands, one module per group, each command's parser beside the function that runs it:

- `load`: a deployment or stacks started here under load: run, compare, ceiling, tune, ab, diagnose.
- `faults`: load while something goes wrong: chaos (kills, a Redis failover), hostile (attacks).
- `parts`: one part alone: feed (the GPU worker), bound (the device profile's floor), nms, instructions.
- `common`: what the groups share: the parent parsers (`--corpus`, the loads; the local stacks' options), the
  stack options they make, the report.

Each group's `add_commands(sub, common, local)` adds its parsers and returns {command: function}; bench/__main__.py
dispatches on it.
"""
