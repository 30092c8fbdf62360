"""contract.runtime.memory: a process that handles megabyte buffers keeps reusing the same memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Builds and drops 1 MB buffers the way a worker does per image (bytes joined, a bytearray, a copy),
# then prints the page faults taken while doing it 200 times.
_PROBE = """
import resource, sys
from contract.runtime.memory import keep_freed_memory
tuned = keep_freed_memory() if sys.argv[1] == "tune" else False
chunk = b"x" * 1000
def one_image():
    upload = b"".join([chunk] * 1000)
    pixels = bytearray(upload)
    frame = bytes(pixels) + b"header"
    return len(frame)
for _ in range(20):
    one_image()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    one_image()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, **env: str) -> tuple[str, int]:
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
        **env,
        "PYTHONPATH": str(REPO_ROOT),
    }
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env=environ, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_megabytes_are_reused_without_page_faults() -> None:
    untuned, faults_untuned = _faults("plain")
    tuned, faults_tuned = _faults("tune")
    assert (untuned, tuned) == ("False", "True")
    assert faults_untuned > 200 * 100  # glibc's own way: fresh pages for (nearly) every buffer
    assert faults_tuned < faults_untuned / 20


def test_the_users_own_malloc_thresholds_are_left_alone() -> None:
    tuned, _ = _faults("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert tuned == "False"
