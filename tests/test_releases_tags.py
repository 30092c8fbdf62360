"""`python -m tools.releases tag` (issue 69): RELEASES is the one record of the releases, and the tags are made from
it, in a temporary clone here (tags do not travel with every copy: this repository had none for 0.2.0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO_ROOT
from tools.releases import releases


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _releases_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.releases", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def test_tag_makes_each_release_tag_at_its_commit_and_refuses_one_that_points_elsewhere(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(REPO_ROOT), str(clone)], check=True)
    _git(clone, "checkout", "--quiet", "HEAD", "--", "RELEASES")
    for tag in _git(clone, "tag", "--list").split():
        _git(clone, "tag", "-d", tag)
    known = releases(clone)
    assert [version for version, _, _ in known][:2] == ["0.1.0", "0.2.0"]

    made = _releases_command("tag", "--repo", str(clone))
    assert made.returncode == 0, made.stderr
    assert made.stdout.split("\n")[: len(known)] == [f"tagged v{version}" for version, _, _ in known]
    for version, _, commit in known:
        assert _git(clone, "rev-parse", f"v{version}^{{commit}}") == commit
    again = _releases_command("tag", "--repo", str(clone))
    assert again.returncode == 0 and again.stdout == "every release is tagged\n", again

    _git(clone, "tag", "-f", "v0.2.0", known[0][2])  # moved by hand to another commit
    refused = _releases_command("tag", "--repo", str(clone))
    assert refused.returncode == 1 and "refused v0.2.0 names " + known[0][2] in refused.stderr, refused
    assert _git(clone, "rev-parse", "v0.2.0^{commit}") == known[0][2]  # left as it was
    listed = _releases_command("list", "--repo", str(clone)).stdout.splitlines()
    assert listed[0].endswith("tagged") and listed[1].endswith(f"tag names {known[0][2]}"), listed
