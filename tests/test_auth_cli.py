"""`python -m app.auth`, which prints the hash of an API key to configure (issue 69): `--help` was hashed as a key."""

from __future__ import annotations

import subprocess
import sys

from app.auth import hash_key
from tests.support import REPO_ROOT


def _auth(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.auth", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def test_help_prints_the_usage_and_hashes_nothing():
    shown = _auth("--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage:") and "key" in shown.stdout, shown.stdout
    assert hash_key("--help") not in shown.stdout


def test_a_key_prints_its_sha256_and_no_key_is_refused():
    assert _auth("key-a").stdout == hash_key("key-a") + "\n"
    refused = _auth()
    assert refused.returncode == 2 and "usage:" in refused.stderr and refused.stdout == "", refused
