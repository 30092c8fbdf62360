"""The `failover` scenario of the fault harness (bench.faults.harness): make run's stack behind Sentinel
(tools.redis_ha), steady load, and the primary SIGKILLed under it; `back_after_s` after the kill the killed server
starts again (as a replica). The verdict is the history checker's (nothing lost, gone back or ended twice; the first 202
after the Sentinels settled), and this scenario's own: no process restarted by the supervisor (each rode the failover
out), and the role the killed server came back as.

    python -m bench chaos --scenario failover --qps 15 --kill-at 6 --back-after 6
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.faults.harness import FaultScenario, Log
from bench.stack.local import ProcfileStack, StackOptions


def failover(options: StackOptions, back_after_s: float = 10.0) -> FaultScenario:
    options = replace(options, sentinel=True)
    killed: list[str] = []

    def fault(stack: ProcfileStack, log: Log) -> tuple[float, float]:
        assert stack.ha is not None
        killed.append(stack.ha.kill_primary())
        killed_at = time.monotonic()
        log(f"SIGKILL the primary ({killed[-1]}); the Sentinels will promote the replica")
        promoted = stack.ha.wait_settled(60)
        settled_at = time.monotonic()
        log(f"the Sentinels name {promoted} the primary, {settled_at - killed_at:.1f} s after the kill")
        time.sleep(max(0.0, killed_at + back_after_s - time.monotonic()))
        stack.ha.restart(killed[-1])
        log(f"{killed[-1]} is back; the Sentinels make it a replica of {promoted}")
        return killed_at, settled_at

    def report(stack: ProcfileStack) -> dict[str, Any]:
        assert stack.ha is not None
        supervisor = stack.supervisor.log_tail(2_000_000) if stack.supervisor else ""
        return {
            "restarted": supervisor.count(" restarted (pid"),
            "killed_comes_back_as": _settled_role(stack, killed[-1]) if killed else None,
            "reported": ("restarted", "killed_comes_back_as"),
        }

    return FaultScenario(
        "failover",
        "make run's stack behind Sentinel: the primary SIGKILLed under load, back later as a replica",
        start=lambda: ProcfileStack(Path(tempfile.mkdtemp(prefix="failover-")), options).start(),
        fault=fault,
        report=report,
        ok=lambda verdict: verdict["restarted"] == 0,
    )


def _settled_role(stack: ProcfileStack, name: str, limit_s: float = 30.0) -> str | None:
    """The killed server's role once the Sentinels have made it a replica, or as it stands after `limit_s`: a
    Sentinel reconfigures a returning old primary when it next looks at it (its INFO every 10 s)."""
    assert stack.ha is not None
    until = time.monotonic() + limit_s
    while (role := stack.ha.role(name)) != "slave" and time.monotonic() < until:
        time.sleep(0.5)
    return role
