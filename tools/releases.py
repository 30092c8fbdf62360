"""`RELEASES`, the one record of the releases (docs/releasing.md): its reader, and the tags made from it.

    python -m tools.releases list            # version, date, commit, and whether its tag is there
    python -m tools.releases tag [--repo .]  # makes each release's vX.Y.Z tag at its commit

Tags do not travel with every copy of the repository (a host that keeps none, a clone without them): RELEASES
does, and `tag` makes them again from it. A tag already at its commit is left alone; one that points elsewhere is
refused, named, and nothing of it changed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def releases(root: Path = REPO_ROOT) -> list[tuple[str, str, str]]:
    """`RELEASES`' lines, oldest first: (version, date, commit)."""
    lines = [line.split() for line in (root / "RELEASES").read_text().splitlines() if line.strip()]
    return [(line[0], line[1], line[2]) for line in lines if not line[0].startswith("#")]


def tag_name(version: str) -> str:
    return f"v{version}"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)


def tagged_commit(repo: Path, tag: str) -> str | None:
    """The commit a tag names in `repo`, or None when there is no such tag."""
    found = _git(repo, "rev-parse", "--verify", "--quiet", f"refs/tags/{tag}^{{commit}}")
    return found.stdout.strip() if found.returncode == 0 else None


def make_tags(repo: Path) -> tuple[list[str], list[str]]:
    """Each release's tag at its commit, from `repo`'s RELEASES: (made, refused: why, one line each). A tag
    already at its commit is neither."""
    made, refused = [], []
    for version, _, commit in releases(repo):
        tag = tag_name(version)
        if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            refused.append(f"{tag}: commit {commit} is not in this repository")
            continue
        current = tagged_commit(repo, tag)
        if current == commit:
            continue
        if current is not None:
            refused.append(f"{tag} names {current}, but RELEASES says {commit}: left as it is")
            continue
        created = _git(repo, "tag", tag, commit)  # lightweight, as docs/releasing.md's: no tagger identity needed
        if created.returncode != 0:
            refused.append(f"{tag}: git tag failed: {created.stderr.strip()}")
        else:
            made.append(tag)
    return made, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.releases", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["list", "tag"], help="list the releases, or make their tags")
    parser.add_argument("--repo", type=Path, default=REPO_ROOT, help="the repository (default: this checkout)")
    args = parser.parse_args(argv)
    if args.command == "list":
        for version, date, commit in releases(args.repo):
            at = tagged_commit(args.repo, tag_name(version))
            state = "tagged" if at == commit else "untagged" if at is None else f"tag names {at}"
            print(f"{version} {date} {commit} {state}")
        return 0
    made, refused = make_tags(args.repo)
    for tag in made:
        print(f"tagged {tag}")
    for why in refused:
        print(f"refused {why}", file=sys.stderr)
    if not made and not refused:
        print("every release is tagged")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
