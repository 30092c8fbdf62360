"""Load while something goes wrong: the one fault harness (`harness`), the history checker (`history`), and its
scenarios: kills, a Redis failover, a rolling upgrade, cells killed or cut off, partitions between hosts. Imports
the stack, meters and load wings."""
