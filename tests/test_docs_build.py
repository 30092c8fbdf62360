"""The docs site's strict build (issue 69): every page of docs/ is in mkdocs.yml's nav, and `make lint`'s docs step
fails on any warning. Its `--quiet` raised mkdocs' log level past WARNING, so the strict build counted no warning and
passed while two benchmark logs were missing from the nav."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO_ROOT

DOCS = REPO_ROOT / "docs"


def _nav_pages(entries: Any) -> Iterator[str]:
    """Every page a nav names, sections walked."""
    if isinstance(entries, str):
        yield entries
    elif isinstance(entries, list):
        for entry in entries:
            yield from _nav_pages(entry)
    elif isinstance(entries, dict):
        for value in entries.values():
            yield from _nav_pages(value)


def _mkdocs_config() -> dict[str, Any]:
    # mkdocs.yml may name Python objects (!!python/name:); their names do not matter here
    return yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text().replace("!!python/name:", ""))


def test_every_page_of_the_docs_is_in_the_nav():
    nav = set(_nav_pages(_mkdocs_config()["nav"]))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert pages - nav == set(), "pages of docs/ missing from mkdocs.yml's nav"
    assert nav - pages == set(), "nav entries with no page"


def _lint_docs_command() -> str:
    """The Makefile's `lint` recipe line that builds the docs, as CI runs it."""
    recipe = (REPO_ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    lines = [line.strip() for line in recipe.splitlines() if "mkdocs build" in line]
    assert len(lines) == 1, recipe
    return lines[0]


def test_make_lints_docs_build_fails_on_a_page_missing_from_the_nav(tmp_path: Path):
    """make lint's own docs command, on today's docs plus one page the nav does not name: it must fail."""
    (tmp_path / "mkdocs.yml").symlink_to(REPO_ROOT / "mkdocs.yml")
    (tmp_path / ".venv").symlink_to(REPO_ROOT / ".venv")
    docs = tmp_path / "docs"
    docs.mkdir()
    for entry in DOCS.iterdir():
        (docs / entry.name).symlink_to(entry)
    (docs / "not-in-the-nav.md").write_text("# A page nobody linked\n")
    command = _lint_docs_command()
    built = subprocess.run(
        ["sh", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    output = built.stdout + built.stderr
    assert built.returncode != 0, f"`{command}` passed with a page missing from the nav:\n{output}"
    assert re.search(r"not included in the \"nav\"[^\n]*\n\s*- not-in-the-nav\.md", output), output
