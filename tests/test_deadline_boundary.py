"""One definition of "past a deadline" (contract/deadlines.py: the service's clock strictly beyond it), held at the
boundary by each place that judges it: Python's `is_past`, the Lua steps' `deadline_passed`, and the deadline
index's sweep (`JobEnding.expire_overdue`, which had counted a deadline equal to now as past: issue 63, item 2)."""

from __future__ import annotations

import redis

from contract.deadlines import DEADLINE_PASSED_LUA, is_past, live_scores, overdue_scores
from contract.jobs.intake import JobIntake
from contract.keys import Keys

DEADLINE = 1_800_000_000.25  # exact in binary: equal means equal in Python, Lua and Redis's scores


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
