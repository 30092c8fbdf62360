"""Freed memory stays in the process for the next image, instead of going back to the kernel.

Every image passes through buffers of about a megabyte in each process: the
upload (API, CPU worker), the decoded and resized pixels, the frame (CPU
worker, GPU worker). glibc's malloc serves blocks that size from mmap, or grows
its heap for them and trims it again on free, so each buffer is fresh memory
that the kernel must map and zero page by page: measured on the CPU worker's
decode, letterbox and pack of one 1080p JPEG, 1,037 page faults and 3 ms of
system CPU, against 11 ms of the work itself. With the thresholds below the
same loop takes no page fault and no system time. In the running stack glibc's
own adaptive threshold already avoids most of it (about 50 faults per image per
process remain): four interleaved A/B runs at 18 QPS gave 0.1-0.2 less in
`stack/bench` (about half a millisecond per image), most of it in the API.

The price is resident memory: a process keeps what it once needed, up to
TRIM_THRESHOLD_BYTES of free memory at its heap's top.
Set glibc's own MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ to choose
otherwise; then this leaves malloc alone.
"""
from __future__ import annotations

import ctypes
import os

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap (glibc's upper limit on 64-bit; a Pillow block is 16 MiB).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# Free memory at the heap's top is given back only beyond this.
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024
_USER_CHOICE = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Tune this process's malloc (and that of the children it forks later); True if it did. Without
    glibc (no mallopt), or with the user's own thresholds in the environment, it changes nothing."""
    if any(name in os.environ for name in _USER_CHOICE):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                   TRIM_THRESHOLD_BYTES))
