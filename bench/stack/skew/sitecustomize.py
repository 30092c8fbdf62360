"""Moves this Python process's wall clock by IMGSERVE_SKEW_S seconds (bench.stack.hosts: a host whose clock is off).

Only `time.time` and `time.time_ns` move: the monotonic clock, sleeps and timeouts stay as they are, as on a
host whose wall clock is set wrong. (libfaketime moved more, and disturbed the GPU worker's timed waits even at a
zero offset: shared/notes/several-hosts.md.)"""

import os
import time

_OFFSET_S = float(os.environ.get("IMGSERVE_SKEW_S") or 0.0)

if _OFFSET_S:
    _wall, _wall_ns = time.time, time.time_ns
    _OFFSET_NS = int(_OFFSET_S * 1e9)
    time.time = lambda: _wall() + _OFFSET_S
    time.time_ns = lambda: _wall_ns() + _OFFSET_NS
