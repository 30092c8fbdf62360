"""This checkout's release: pyproject.toml's `version` (docs/releasing.md; a test holds the two together). A frame
carries its writer's, so that a reader of another release can say which release wrote what it cannot read
(docs/upgrading.md's rule)."""

from __future__ import annotations

RELEASE = "0.2.0"
