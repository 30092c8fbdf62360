"""The `cell-kill` scenario of the fault harness (bench.faults.harness; docs/cells.md): two cells on one machine, each a
whole stack of its own (its Redis with an append-only file fsynced on every write, CPU worker, GPU worker), one
API (gunicorn, as deployed) over both with `IMGSERVE_CELLS`; under steady load the second cell's Redis is
SIGKILLed, stays dead for `--back-after` seconds, and comes back with its file. The verdict is the history
checker's (nothing lost, in either cell: the dead cell's jobs are read again once it is back), and this scenario's
own: no submission answered 5xx while the cell was dead or after.

    python -m bench chaos --scenario cell-kill --qps 8 --duration 40 --back-after 10
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.faults.harness import FaultScenario, Log
from bench.stack.local import LocalStack, StackOptions, answers_ok, api_env
from bench.stack.processes import ManagedProcess, api_argv, free_port, wait_until


class CellsStack:
    """Two LocalStacks (the cells) and one API process over both."""

    def __init__(self, workdir: Path, options: StackOptions) -> None:
        self.workdir, self.options = workdir, options
        self.cells: list[LocalStack] = []
        self.api: ManagedProcess | None = None
        self.url = ""

    def start(self) -> CellsStack:
        for name in ("a", "b"):
            self.cells.append(LocalStack(self.workdir / name, self.options).start())
        first = self.cells[0]
        assert first.redis is not None and self.cells[1].redis is not None
        cells = [{"name": name, "redis_url": cell.redis.url} for name, cell in zip("ab", self.cells) if cell.redis]
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **first.env,
            **api_env(port, self.options.api_workers, self.options.api_threads),
            "IMGSERVE_CELLS": json.dumps(cells),  # JSON is YAML's flow style
            "IMGSERVE_REDIS_URL": first.redis.url,  # the tier's Redis: the first cell's
            "IMGSERVE_BULK__RETRY_S": "1.0",
        }
        self.api = ManagedProcess("cells-api", api_argv(access_log=False), env, self.workdir)
        wait_until(lambda: answers_ok(self.url + "/readyz", [self.api] if self.api else []), 120, what="the API")
        return self

    def stop(self) -> None:
        if self.api is not None:
            self.api.stop()
        for cell in reversed(self.cells):
            cell.stop()


def cell_kill(options: StackOptions, back_after_s: float) -> FaultScenario:
    options = replace(options, persistent_redis=True)
    return FaultScenario(
        "cell-kill",
        "two cells behind one API: the second cell's Redis SIGKILLed under load, back (its append-only file) later",
        start=lambda: CellsStack(Path(tempfile.mkdtemp(prefix="chaos-cells-")), options).start(),
        fault=lambda stack, log: _kill_cell(stack, back_after_s, log),
        ok=no_server_errors,
    )


def _kill_cell(stack: CellsStack, back_after_s: float, log: Log) -> tuple[float, float]:
    redis = stack.cells[1].redis
    assert redis is not None
    started = time.monotonic()
    os.kill(redis.process.pid, signal.SIGKILL)
    redis.process.wait(10)
    log(f"SIGKILL the second cell's redis-server ({redis.url}); back in {back_after_s:g} s")
    time.sleep(back_after_s)
    redis.start()
    log("the second cell's redis-server is back")
    return started, time.monotonic()


def no_server_errors(verdict: dict[str, Any]) -> bool:
    """No submission refused with a 5xx (or not answered) during the fault or after it."""
    refused = verdict.get("refused", {})
    return not any(not kind.startswith("4") for phase in ("during", "after") for kind in refused.get(phase, {}))
