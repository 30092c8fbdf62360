"""Releases (docs/releasing.md): the version in pyproject.toml is the one the code says (contract.runtime.release,
written into every frame), RELEASES lists each release once, oldest first, ending with it, and CHANGELOG.md has its
section."""

from __future__ import annotations

import re
import tomllib

from bench.stack.processes import REPO_ROOT
from contract.runtime.release import RELEASE
from tools.releases import releases


def test_the_release_is_one_number_in_pyproject_the_code_releases_and_the_changelog():
    assert tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"] == RELEASE
    known = releases()
    assert all(re.fullmatch(r"[0-9a-f]{40}", commit) for _, _, commit in known), known
    versions = [tuple(int(part) for part in version.split(".")) for version, _, _ in known]
    assert versions == sorted(set(versions)) and known[-1][0] == RELEASE
    assert re.search(
        rf"^## \[{re.escape(RELEASE)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", (REPO_ROOT / "CHANGELOG.md").read_text(), re.M
    )
