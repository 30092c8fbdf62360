"""Two more cell scenarios of the fault harness (bench.faults.harness; docs/cells.md), beside `cell-kill`:

- `cell-gpu-kill`: two cells behind one API (bench.faults.cell_kill's CellsStack); under steady load the second cell's
  GPU worker is SIGKILLed and started again `--back-after` seconds later. Its backlog grows with no rate, so the
  chooser sends new jobs to the first cell; the second cell's accepted jobs wait and succeed once its GPU worker
  is back. Checked: nothing lost in either cell (the history checker), no 5xx, and no job placed in the dead cell
  once the chooser had had time to see it (its GPU worker's heartbeat expired, and a second's reading).
- `cell-failover`: two cells, each behind Sentinel (tools.redis_ha: a primary, two replicas, three Sentinels),
  each with its own CPU worker and GPU worker, one API over both; under load the second cell's primary is
  SIGKILLed, the Sentinels promote a replica, the killed server comes back as a replica. Checked: nothing lost in
  either cell (every 202 waited for a replica), no 5xx.

    python -m bench chaos --scenario cell-gpu-kill --qps 6 --duration 45 --back-after 25
    python -m bench chaos --scenario cell-failover --qps 6 --duration 30 --back-after 8
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import redis
import yaml

from bench.faults.cell_kill import CellsStack, no_server_errors
from bench.faults.harness import FaultScenario, Log
from bench.stack.local import StackOptions, answers_ok, api_env
from bench.stack.processes import ManagedProcess, api_argv, cpu_worker_argv, free_port, gpu_worker_argv, wait_until
from contract.redis.keys import Keys

SEEN_DEAD_S = 2.0  # after the heartbeat's expiry: the chooser's once-a-second reading, and a margin


def _jobs_in(url: str) -> int:
    """How many job records a cell's Redis holds (each accepted job writes one)."""
    client = redis.Redis.from_url(url, socket_timeout=5)
    pattern = Keys().job("*")
    return sum(1 for _ in client.scan_iter(match=pattern, count=1000))


def cell_gpu_kill(options: StackOptions, back_after_s: float, heartbeat_ttl_s: float = 10.0) -> FaultScenario:
    placed: dict[str, int] = {}

    def fault(stack: CellsStack, log: Log) -> tuple[float, float]:
        living, dead = stack.cells
        assert living.redis is not None and dead.redis is not None
        started = time.monotonic()
        dead.process("gpu-worker").stop(signal.SIGKILL)
        log(f"SIGKILL the second cell's GPU worker; back in {back_after_s:g} s")
        time.sleep(heartbeat_ttl_s + SEEN_DEAD_S)
        before = {"living": _jobs_in(living.redis.url), "dead": _jobs_in(dead.redis.url)}
        time.sleep(max(0.0, started + back_after_s - time.monotonic()))
        after = {"living": _jobs_in(living.redis.url), "dead": _jobs_in(dead.redis.url)}
        placed.update({f"{cell}_while_seen_dead": after[cell] - before[cell] for cell in after})
        dead.restart("gpu-worker")
        log(f"the second cell's GPU worker is back; while it was seen dead: {placed}")
        return started, time.monotonic()

    def report(stack: CellsStack) -> dict[str, Any]:
        dead = stack.cells[1].redis
        assert dead is not None
        found = {**placed, "dead_cell_jobs": _jobs_in(dead.url)}  # every one of them followed to its end
        return {**found, "reported": tuple(found)}

    return FaultScenario(
        "cell-gpu-kill",
        "two cells behind one API: the second cell's GPU worker SIGKILLed under load, started again later",
        start=lambda: CellsStack(Path(tempfile.mkdtemp(prefix="chaos-cell-gpu-")), options).start(),
        fault=fault,
        report=report,
        ok=lambda verdict: (
            no_server_errors(verdict) and verdict["dead_while_seen_dead"] == 0 and verdict["living_while_seen_dead"] > 0
        ),
    )


class SentinelCellsStack:
    """Two cells, each a tools.redis_ha set (primary, two replicas, three Sentinels) with its own CPU worker and
    GPU worker, and one API over both: every process finds its cell's primary through its Sentinels."""

    def __init__(self, workdir: Path, options: StackOptions) -> None:
        self.workdir, self.options = workdir, options
        self.sets: list[Any] = []
        self.processes: list[ManagedProcess] = []
        self.url = ""

    def start(self) -> SentinelCellsStack:
        from tools.redis_ha import RedisHA

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name in ("IMGSERVE_REDIS_URL", "PROMETHEUS_MULTIPROC_DIR", "IMGSERVE_CELLS"):
            env.pop(name, None)
        cells = []
        for name in ("a", "b"):
            folder = self.workdir / name
            ha = RedisHA(folder / "redis-ha").start()
            self.sets.append(ha)
            # with Sentinels only the URL's database and password count; the primary's first address keeps the
            # two cells' URLs apart
            url = f"redis://127.0.0.1:{ha.nodes['a'].port}/0"
            sentinel = {"sentinels": ha.sentinels, "service": ha.service}
            config = {**self.options.config(url, []), "redis": sentinel}
            (folder / "config.yaml").write_text(yaml.safe_dump(config))
            cell_env = {**env, "IMGSERVE_CONFIG": str(folder / "config.yaml")}
            workers = cast(int, self.options.cpu_workers)
            self._spawn(f"cpu-worker-{name}", cpu_worker_argv(workers), cell_env, folder)
            self._spawn(
                f"gpu-worker-{name}", gpu_worker_argv(self.options.device, f"cells-gpu-{name}"), cell_env, folder
            )
            cells.append({"name": name, "redis_url": url, "redis": sentinel})
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        api_env_vars = {
            **env,
            "IMGSERVE_CONFIG": str(self.workdir / "a" / "config.yaml"),  # the tier's Redis: the first cell's
            **api_env(port, self.options.api_workers, self.options.api_threads),
            "IMGSERVE_CELLS": json.dumps(cells),
            "IMGSERVE_BULK__RETRY_S": "1.0",
        }
        self._spawn("cells-api", api_argv(access_log=False), api_env_vars, self.workdir)
        wait_until(lambda: answers_ok(self.url + "/readyz", self.processes), 120, what="the API")
        return self

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], folder: Path) -> None:
        self.processes.append(ManagedProcess(name, argv, env, folder, root=self.options.root))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        for ha in reversed(self.sets):
            ha.stop()


def cell_failover(options: StackOptions, back_after_s: float) -> FaultScenario:
    killed: list[str] = []

    def fault(stack: SentinelCellsStack, log: Log) -> tuple[float, float]:
        ha = stack.sets[1]
        killed.append(ha.kill_primary())
        killed_at = time.monotonic()
        log(f"SIGKILL the second cell's primary ({killed[-1]}); its Sentinels will promote a replica")
        promoted = ha.wait_settled(60)
        settled_at = time.monotonic()
        log(f"the second cell's Sentinels name {promoted} the primary, {settled_at - killed_at:.1f} s after the kill")
        time.sleep(max(0.0, killed_at + back_after_s - time.monotonic()))
        ha.restart(killed[-1])
        log(f"{killed[-1]} is back, a replica of {promoted}")
        return killed_at, settled_at

    return FaultScenario(
        "cell-failover",
        "two cells each behind Sentinel, one API: the second cell's primary SIGKILLed under load, back as a replica",
        start=lambda: SentinelCellsStack(Path(tempfile.mkdtemp(prefix="chaos-cell-ha-")), options).start(),
        fault=fault,
        ok=no_server_errors,
    )


def gpu_kill_options(options: StackOptions) -> StackOptions:
    """The scenario's stack: the cells' Redis with their append-only files, as cell-kill's."""
    return replace(options, persistent_redis=True)
