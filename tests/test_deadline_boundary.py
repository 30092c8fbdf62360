"""One definition of "past a deadline" (contract/jobs/deadlines.py: the service's clock strictly beyond it), held at the
boundary by each place that judges it: Python's `is_past`, the Lua steps' `deadline_passed`, and the deadline
index's sweep (`JobEnding.expire_overdue`, which had counted a deadline equal to now as past: issue 63, item 2)."""

from __future__ import annotations

import pytest
import redis

from contract.jobs.deadlines import is_past, live_scores, overdue_scores
from contract.jobs.intake import JobIntake
from contract.library import HERE as LIBRARY
from contract.redis.keys import Keys

DEADLINE = 1_800_000_000.25  # exact in binary: equal means equal in Python, Lua and Redis's scores

# The library's own judgement (contract/library/deadlines.lua), run alone as a script.
DEADLINE_PASSED_LUA = (LIBRARY / "deadlines.lua").read_text()


def test_each_judge_says_a_deadline_equal_to_now_is_not_past_and_a_moment_later_is(redis_client: redis.Redis):
    just_after = DEADLINE + 0.25
    assert (is_past(DEADLINE, DEADLINE), is_past(DEADLINE, just_after)) == (False, True)
    lua = redis_client.register_script(DEADLINE_PASSED_LUA + "return deadline_passed(tonumber(ARGV[1]), ARGV[2])")
    assert [lua(args=[repr(DEADLINE), repr(now)]) for now in (DEADLINE, just_after)] == [None, 1]
    keys = Keys("boundary")
    intake = JobIntake(redis_client, keys, ttl_s=60)
    intake.create("b" * 32, b"upload", 60, {"deadline_at": DEADLINE})
    assert redis_client.zrangebyscore(keys.deadlines, *overdue_scores(DEADLINE)) == []
    assert redis_client.zrangebyscore(keys.deadlines, *live_scores(DEADLINE)) == [b"b" * 32]
    assert intake.expire_overdue(DEADLINE) == 0 and intake.load("b" * 32)["status"] == "queued"
    assert redis_client.zrangebyscore(keys.deadlines, *live_scores(just_after)) == []
    assert intake.expire_overdue(just_after) == 1 and intake.load("b" * 32)["status"] == "expired"


def test_the_deadline_policy_lives_with_the_arithmetic():
    """Which deadline a job gets (issue 63, item 2): its own up to its model's default, else that default; a
    longer one is refused with what the model allows; the query's bound is the longest default. A margin judges
    'no time left' with the same comparison as past."""
    from contract.jobs.deadlines import DeadlineTooLong, applied_deadline_ms, is_past, longest_deadline_ms

    assert applied_deadline_ms(None, 5000, "m:1") == 5000 and applied_deadline_ms(5000, 5000, "m:1") == 5000
    assert applied_deadline_ms(1, 5000, "m:1") == 1
    with pytest.raises(DeadlineTooLong) as refused:
        applied_deadline_ms(5001, 5000, "m:1")
    assert refused.value.reason == "at most 5000 ms for model m:1" and str(refused.value).startswith("deadline_ms=5001")
    assert longest_deadline_ms([5000, 60000, 200]) == 60000
    assert not is_past(10.0, now=9.5, margin_s=0.5) and is_past(10.0, now=9.5 + 1e-9, margin_s=0.5)


def test_every_place_that_expires_a_job_goes_through_contract_expiry():
    """Expiry in one home (issue 72, item 5): outside contract.jobs.expiry (and the store's own mechanics in
    contract.jobs.ending) no process judges a deadline, ends a job `expired` or sweeps the deadline index itself:
    each calls contract.jobs.expiry, which says who may, and when."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    direct = re.compile(
        r"\bstore\.expire\(|(?<!expiry\.)\bexpire_overdue\(|\bis_past\(|(?<!expiry\.)\bexpired_fields\("
    )
    found = [
        f"{path.relative_to(root)}:{number}"
        for folder in ("app", "tasks", "gpu_worker", "contract")
        for path in sorted((root / folder).rglob("*.py"))
        if path.name not in ("expiry.py", "ending.py", "deadlines.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert found == [], found
    assert "local function late_as_expired" not in (LIBRARY / "ending.lua").read_text()
    assert "local function late_as_expired" in DEADLINE_PASSED_LUA  # the library's side of the rule, in one file
