"""The `cell-cut` scenario of the fault harness (bench.faults.harness; docs/cells.md): two cells and the API tier as
three hosts (bench.stack.hosts: a network namespace each, joined by one bridge; needs root and iptables). Each cell's
host runs its redis-server (an append-only file fsynced on every write), its CPU worker and its GPU worker; the API's
host runs the API with `IMGSERVE_CELLS`. Under steady load the second cell's host is cut off from the API's (both ways;
the cell's own workers still reach its Redis, the client reaches every host), and the cut healed `--back-after` seconds
later. While cut the cell is to the API what a killed one is: new submissions go to the first cell, its jobs answer 503;
after the heal its jobs are read again (every accepted job followed to its end: the history checker) and it takes new
work.

    python -m bench chaos --scenario cell-cut --qps 6 --duration 40 --back-after 10
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import redis
import yaml

from bench.faults.cell_kill import no_server_errors
from bench.faults.harness import FaultScenario, Log
from bench.stack.hosts import Host, Network, check_can_make_hosts
from bench.stack.local import StackOptions, answers_ok, api_env
from bench.stack.processes import api_argv, cpu_worker_argv, free_port, gpu_worker_argv, wait_until
from contract.redis.keys import Keys

REDIS_PORT = 6379  # each cell's host has its own address: one port for all


class CellsOnHosts:
    """The API's host and two cells' hosts on one network."""

    def __init__(self, workdir: Path, options: StackOptions) -> None:
        self.workdir, self.options = workdir, options
        self.network = Network.create()
        self.cells: list[Host] = []
        self.url = ""

    def redis_url(self, cell: Host) -> str:
        return f"redis://{cell.address}:{REDIS_PORT}/0"

    def start(self) -> CellsOnHosts:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> CellsOnHosts:
        api = self.network.add_host("api")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name in ("IMGSERVE_REDIS_URL", "PROMETHEUS_MULTIPROC_DIR", "IMGSERVE_CELLS"):
            env.pop(name, None)
        for name in ("a", "b"):
            host = self.network.add_host(f"cell-{name}")
            self.cells.append(host)
            folder = self.workdir / name
            folder.mkdir(parents=True)
            host.spawn("redis", _redis_argv(host, folder), env, folder)
            client = redis.Redis.from_url(self.redis_url(host), socket_timeout=2)
            wait_until(partial(_pings, client), 30, what=f"cell {name}'s Redis")
            (folder / "config.yaml").write_text(yaml.safe_dump(self.options.config(self.redis_url(host), [])))
            cell_env = {**env, "IMGSERVE_CONFIG": str(folder / "config.yaml")}
            host.spawn("cpu-worker", cpu_worker_argv(self.options.cpu_workers or 2), cell_env, folder)
            host.spawn("gpu-worker", gpu_worker_argv(self.options.device, f"cut-gpu-{name}"), cell_env, folder)
        cells = [{"name": name, "redis_url": self.redis_url(host)} for name, host in zip("ab", self.cells)]
        port = free_port()
        self.url = f"http://{api.address}:{port}"
        api_vars = {
            **env,
            "IMGSERVE_CONFIG": str(self.workdir / "a" / "config.yaml"),  # the tier's Redis: the first cell's
            **api_env(port, self.options.api_workers, self.options.api_threads),
            "IMGSERVE_API__BIND": f"{api.address}:{port}",
            "IMGSERVE_CELLS": json.dumps(cells),
            "IMGSERVE_BULK__RETRY_S": "1.0",
        }
        process = api.spawn("api", api_argv(access_log=False), api_vars, self.workdir)
        wait_until(lambda: answers_ok(self.url + "/readyz", [process]), 120, what="the API")
        return self

    def stop(self) -> None:
        try:
            for host in reversed(list(self.network.hosts.values())):
                for process in reversed(host.processes):
                    process.stop()
        finally:
            self.network.close()


def _redis_argv(host: Host, folder: Path) -> list[str]:
    # reached from other hosts: bound to the host's address, protected mode off (no password on this private net)
    return [
        "redis-server",
        *("--bind", host.address, "127.0.0.1", "--port", str(REDIS_PORT), "--protected-mode", "no"),
        *("--dir", str(folder), "--appendonly", "yes", "--appendfsync", "always", "--save", ""),
    ]


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _jobs_in(url: str) -> int:
    client = redis.Redis.from_url(url, socket_timeout=5)
    return sum(1 for _ in client.scan_iter(match=Keys().job("*"), count=1000))


def cell_cut(options: StackOptions, back_after_s: float) -> FaultScenario:
    counts: dict[str, int] = {}

    def fault(stack: CellsOnHosts, log: Log) -> tuple[float, float]:
        living, cut = stack.cells
        api = stack.network.hosts["api"]
        before = _jobs_in(stack.redis_url(cut))
        stack.network.partition([cut], [api])
        started = time.monotonic()
        log(f"the second cell's host cut off from the API's; healed in {back_after_s:g} s")
        time.sleep(back_after_s)
        counts["cut_cell_jobs_placed_while_cut"] = _jobs_in(stack.redis_url(cut)) - before
        counts["cut_cell_jobs_at_heal"] = _jobs_in(stack.redis_url(cut))
        stack.network.heal()
        log("healed")
        return started, time.monotonic()

    def report(stack: CellsOnHosts) -> dict[str, Any]:
        found = {**counts, "cut_cell_jobs_placed_after_heal": _jobs_in(stack.redis_url(stack.cells[1]))}
        found["cut_cell_jobs_placed_after_heal"] -= counts.get("cut_cell_jobs_at_heal", 0)
        return {**found, "reported": tuple(found)}

    def start() -> CellsOnHosts:
        check_can_make_hosts()
        return CellsOnHosts(Path(tempfile.mkdtemp(prefix="chaos-cell-cut-")), options).start()

    return FaultScenario(
        "cell-cut",
        "two cells and the API on three hosts: the second cell's host cut off from the API's under load, healed later",
        start=start,
        fault=fault,
        report=report,
        ok=lambda verdict: (
            no_server_errors(verdict)
            and verdict["cut_cell_jobs_placed_while_cut"] <= 1  # a write sent just before the cut took hold
            and verdict["cut_cell_jobs_placed_after_heal"] > 0
        ),
    )
