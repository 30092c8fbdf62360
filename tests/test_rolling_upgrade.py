"""A rolling upgrade from the last release to this checkout, under load, checked as every fault is (issue 62,
docs/upgrading.md): the stack starts at the release (a git worktree), each role is replaced by this checkout's in
the rule's order, and every accepted job must end, once, and not `failed`. Short (five uploads a second for about
half a minute): `bench chaos --scenario upgrade --order both --runs 3` is the long form."""

from __future__ import annotations

import subprocess

import pytest

from bench.faults.harness import RunOptions, format_verdict, run_scenario
from bench.faults.upgrade import last_release, upgrade
from bench.stack.local import StackOptions
from bench.stack.processes import REPO_ROOT
from tests.support import jpeg

pytestmark = pytest.mark.integration


def test_the_last_release_is_a_commit_of_this_history():
    ref = last_release()
    found = subprocess.run(["git", "cat-file", "-t", ref], cwd=REPO_ROOT, capture_output=True, text=True)
    assert found.stdout.strip() == "commit", f"RELEASES names {ref}, which this clone lacks: {found.stderr}"


def test_a_rolling_upgrade_from_the_last_release_loses_and_fails_nothing():
    scenario = upgrade(StackOptions(cpu_workers=1, api_workers=1), last_release(), "api-first", between_s=2.0)
    run = RunOptions(qps=5.0, fault_at_s=3.0, after_s=3.0, deadline_ms=60_000, drain_s=60.0)
    images = [jpeg(320 + 16 * i, 240) for i in range(4)]
    verdict = run_scenario(scenario, images, run, log=lambda line: None)
    assert verdict["accepted"] >= 50, format_verdict(verdict)
    assert verdict["ok"] and verdict["ends"] == {"succeeded": verdict["accepted"]}, format_verdict(verdict)
    assert [h["role"] for h in verdict["handovers"]] == ["api", "gpu-worker", "cpu-worker"]
