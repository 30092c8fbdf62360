"""Latency profiles of the simulated device (`device: sim`): ms per batch size, interpolated."""

from __future__ import annotations

from contract.settings import STORY_PROFILE_MS

# A small detector on a modern GPU: a batch of 8 in a few milliseconds.
FAST_PROFILE_MS = {1: 2.0, 8: 6.0, 16: 10.0}
PROFILES = {"fast": FAST_PROFILE_MS, "story": STORY_PROFILE_MS}


def parse_profile(text: str) -> dict[int, float]:
    """fast, story, or "1:2,8:6,16:10" (ms per batch size)."""
    if text in PROFILES:
        return dict(PROFILES[text])
    try:
        pairs = (part.split(":") for part in text.split(",") if part)
        profile = {int(size): float(ms) for size, ms in pairs}
    except ValueError as exc:
        raise SystemExit(f"--profile {text!r}: expected fast, story or 1:2,8:6,16:10") from exc
    if not profile:
        raise SystemExit(f"--profile {text!r}: expected fast, story or 1:2,8:6,16:10")
    return profile
