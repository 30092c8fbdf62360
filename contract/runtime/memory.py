"""Freed memory stays in the process for the next image, instead of going back to the kernel.

Each image passes through megabyte-sized buffers that glibc would otherwise map and zero afresh (page
faults and system CPU on every image). The price is resident memory: up to TRIM_THRESHOLD_BYTES free
at a heap's top. Set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ to choose otherwise; then this
leaves malloc alone. Measurements: docs/architecture.md ("Buffers stay in the process").
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
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
