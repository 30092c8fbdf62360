"""The `upgrade` scenario of the fault harness (bench.faults.harness, issue 62): the whole stack starts from a git ref
(a worktree), steady load runs with every client operation recorded, and each role is replaced, one at a time, by this
checkout's: SIGTERM to the old process (its own clean hand-over), the new one started with the same command,
settings and environment, the next role once the stack answers again. The verdict is the history checker's
(nothing lost, gone back, ended twice), and this scenario's own: no job ended `failed` (a release that cannot
read the other's record, message or frame ends its jobs failed), and each role's hand-over (how long the stack
did not answer, how the old process exited).

The orders (docs/upgrading.md says which a release supports):
- `api-first`: the API, then the GPU worker, then the CPU worker (the rule's order: a reader before the writer
  it reads);
- `workers-first`: the GPU worker, the CPU worker, then the API.

    python -m bench chaos --scenario upgrade --from 978da47 --order both --runs 3
"""

from __future__ import annotations

import secrets
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.faults.harness import FaultScenario, Log
from bench.load.ab import worktree
from bench.stack.local import LocalStack, StackOptions, answers_ok
from bench.stack.processes import REPO_ROOT, ManagedProcess, wait_until
from tools.releases import releases

ORDERS: dict[str, tuple[str, ...]] = {
    "api-first": ("api", "gpu-worker", "cpu-worker"),
    "workers-first": ("gpu-worker", "cpu-worker", "api"),
}


def upgrade(
    options: StackOptions, from_ref: str, order: str = "api-first", to_root: Path = REPO_ROOT, between_s: float = 4.0
) -> FaultScenario:
    """The scenario: the stack at `from_ref`, its roles replaced in `order` by `to_root`'s, `between_s` of load
    after each new process answers."""
    old_root = worktree(from_ref)
    handovers: list[dict[str, Any]] = []
    # One deployment, one id secret (docs/security.md, "Job ids"): unset, each checkout's API would make its own in
    # its var/, and the new API would answer 404 to every id the old one issued, as a deployment that lost its
    # secret would.
    jobs = {**options.extra.get("jobs", {}), "id_secret": secrets.token_urlsafe(32)}
    options = replace(options, extra={**options.extra, "jobs": jobs})

    def fault(stack: LocalStack, log: Log) -> tuple[float, float]:
        handovers.clear()  # this run's (a scenario runs --runs times)
        began = time.monotonic()
        for role in ORDERS[order]:
            handovers.append(replace_role(stack, role, to_root))
            log(f"upgrade {order}: {role} replaced ({handovers[-1]['down_s']:.1f} s until it answered)")
            time.sleep(between_s)
        return began, time.monotonic()

    return FaultScenario(
        f"upgrade {order} from {from_ref}",
        "a rolling upgrade under load: the stack at --from, each role replaced by this checkout's in --order "
        "(api-first, workers-first)",
        start=lambda: LocalStack(
            Path(tempfile.mkdtemp(prefix=f"upgrade-{order}-")), replace(options, root=old_root)
        ).start(),
        fault=fault,
        report=lambda stack: {"handovers": list(handovers), "reported": ("handovers",)},
        ok=lambda verdict: not verdict["ends"].get("failed"),
    )


def replace_role(stack: LocalStack, role: str, root: Path) -> dict[str, Any]:
    """SIGTERM `role`'s process (it hands over: the API answers what it holds, Celery's warm shutdown, the GPU
    worker's batch), then start the same command from `root`; how long until the stack answers again."""
    old = stack.process(role)
    began = time.monotonic()
    status = old.stop()
    stopped_s = time.monotonic() - began
    stack.processes.remove(old)
    stack.processes.append(ManagedProcess(role, stack.argv[role], stack.env, stack.workdir, root=root))
    # /readyz with every process alive (a new process that dies at start is an error, with its log)
    wait_until(lambda: answers_ok(stack.url + "/readyz", stack.processes), 120, 0.1, what=f"{role} upgraded")
    return {"role": role, "exit": status, "stop_s": round(stopped_s, 2), "down_s": round(time.monotonic() - began, 2)}


def last_release(root: Path = REPO_ROOT) -> str:
    """The commit of the last release."""
    known = releases(root)
    if not known:
        raise SystemExit("RELEASES names no release yet: pass --from REF")
    return known[-1][2]
