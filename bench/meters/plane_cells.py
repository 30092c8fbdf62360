"""`bench plane --cells N`: the phases of `bench plane` run over N cells behind one API (docs/cells.md), against
one cell in the same run, each cell's Redis priced by its own counters.

Each cell is a private redis-server (with its own bulk shards) and its own CPU worker and GPU worker (sim); one
API process with `cells` set (the chooser) takes every submission. The tier's Redis is the first cell's, as
`make run CELLS=N` runs it, so whatever the tier costs is priced into that cell. A cell's cost an image is its
Redis's main-thread µs and commands over the images it took (the cell each id names). The deployment's ceiling is
the rate at which the first cell reaches 70% of its core, with the images split as the chooser split them:
min over cells of (0.7 core / its µs an image) / (its share of the images).

Two choices keep each cell's load what one cell's is, so that a cell's cost an image compares with one cell's: the
API tier grows with the cells (a gunicorn worker and `--clients` HTTP clients a cell: each cell's Redis sees the
pace one cell's does, and a Redis paced more slowly spends more a command on its wake-ups), and the cpu and gpu
steps run cell by cell (each cell's workers started after the previous cell's frames are all pushed or answered):
on a machine of two cores, both cells' workers at once would price the machine's contention into each Redis, which
cells on their own hosts do not pay. Intake and read go through the one API to both cells at once, the chooser
placing every job.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import requests
import yaml

from bench.meters.plane import PHASES, Progress, api_answers, plane_config, tiny_jpegs, total_cost
from bench.meters.plane_cells_report import CELL_NAMES, MainThread, per_image, report, verdict
from bench.meters.plane_meter import InstructionCounter, PhaseCost, RedisReading
from bench.stack.local import api_env
from bench.stack.processes import (
    ManagedProcess,
    RedisServer,
    api_argv,
    cpu_worker_argv,
    free_port,
    gpu_worker_argv,
    wait_until,
)
from contract.jobs.ids import JobIds
from contract.redis.keys import Keys
from contract.settings.config import load_settings


class CellsMeter:
    """Every cell's Redis read around each phase; costs per image worked out once each cell's images are known.
    With counters (callgrind), each cell's instructions too."""

    def __init__(
        self, clients: list[redis.Redis], pids: list[int], counters: list[InstructionCounter] | None = None
    ) -> None:
        self.clients, self.pids, self.counters = clients, pids, counters or []
        self.readings: dict[str, list[tuple[RedisReading, RedisReading]]] = {}
        self.threads: dict[str, list[tuple[MainThread, MainThread]]] = {}  # each cell's main thread around a phase
        self.instructions: dict[str, list[int]] = {}
        self.seconds: dict[str, float] = {}

    def _read(self) -> list[RedisReading]:
        return [RedisReading.of(c) for c in self.clients]

    def _threads(self) -> list[MainThread]:
        return [MainThread.of(c, pid) for c, pid in zip(self.clients, self.pids)]

    def measure(self, phase: str, work: Any) -> Any:
        for counter in self.counters:
            counter.mark()
        threads = self._threads()
        before = self._read()
        started = time.monotonic()
        value = work()
        self.seconds[phase] = time.monotonic() - started
        self.readings[phase] = list(zip(before, self._read()))
        self.threads[phase] = list(zip(threads, self._threads()))
        self.instructions[phase] = [counter.mark() for counter in self.counters]
        return value

    def idle(self, seconds: float) -> list[PhaseCost]:
        """Each cell's Redis with nothing to do, a second's worth (taken out of each phase, as bench plane does)."""
        self.measure("idle", lambda: time.sleep(seconds))
        self.threads.pop("idle")
        costs = [PhaseCost.between(b, a, 1) for b, a in self.readings.pop("idle")]
        counted = self.instructions.pop("idle")
        for index, cost in enumerate(costs):
            cost.us, cost.commands = cost.us / seconds, cost.commands / seconds
            cost.instructions = counted[index] / seconds if counted else None
        return costs

    def net(self, cell: int, images: int, idle: PhaseCost) -> dict[str, PhaseCost]:
        """One cell's cost a phase, per image it took, less its idle rate over the phase's duration."""
        net = {}
        for phase, readings in self.readings.items():
            cost = PhaseCost.between(*readings[cell], max(images, 1))
            share = self.seconds[phase] / max(images, 1)
            instructions = None
            if self.instructions[phase] and idle.instructions is not None:
                instructions = self.instructions[phase][cell] / max(images, 1) - idle.instructions * share
            net[phase] = PhaseCost(
                cost.us - idle.us * share, cost.commands - idle.commands * share, cost.by_command, instructions
            )
        return net


def _none_left(client: redis.Redis, deadlines: str) -> Callable[[], bool]:
    return lambda: client.zcard(deadlines) == 0


def _keys_and_models(config: Path) -> tuple[Keys, list[str]]:
    """A cell's key templates and the models its workers serve, from the configuration they read."""
    settings = load_settings(config)
    return Keys(settings.namespace), [model.key for model in settings.models]


# Every job's deadline past the run: the cells' steps run one cell after the other, and on a loaded 2-core machine
# the last cell's jobs waited past the default 60 s (152 of 1,000 ended `expired`, priced as no GPU step did).
DEADLINE_MS = 480_000  # within jobs.upload_ttl_s (600 s) less the 60 s the settings keep


def cell_config(redis_url: str, shard_urls: list[str], room: int) -> dict[str, Any]:
    """bench plane's settings, every job's deadline past the run."""
    config = plane_config(redis_url, shard_urls, room)
    config["jobs"] = {"default_deadline_ms": DEADLINE_MS}
    return config


@dataclass
class PlaneCell:
    """One cell of the run: its Redis, its bulk shards, the configuration its workers read."""

    server: RedisServer
    shards: list[RedisServer]
    config: Path
    counter: InstructionCounter | None

    @classmethod
    def start(
        cls, folder: Path, shards: int, room: int, instructions: bool = False, core: int | None = None
    ) -> PlaneCell:
        """`core`: the Redis's main thread held to that CPU (its other threads, started already, are not)."""
        folder.mkdir(parents=True, exist_ok=True)
        counter = InstructionCounter(folder) if instructions else None
        server = RedisServer(folder, wrapper=counter.wrapper() if counter else ())
        if counter:
            counter.pid = server.process.pid
        if core is not None:
            os.sched_setaffinity(server.process.pid, {core})
        own = []
        for shard in range(shards):
            (folder / f"shard{shard}").mkdir(exist_ok=True)
            own.append(RedisServer(folder / f"shard{shard}"))
        config = folder / "config.yaml"
        config.write_text(yaml.safe_dump(cell_config(server.url, [s.url for s in own], room)))
        return cls(server, own, config, counter)

    def stop(self) -> None:
        for server in (self.server, *self.shards):
            server.stop()


def _api_config(cells: list[PlaneCell], room: int, workdir: Path) -> Path:
    """The API's settings: the first cell's as the top level (the tier's Redis), and `cells` with two or more."""
    config = cell_config(cells[0].server.url, [s.url for s in cells[0].shards], room)
    if len(cells) > 1:
        config["cells"] = [
            {
                "name": CELL_NAMES[index],
                "redis_url": cell.server.url,
                "bulk": {"redis_urls": [s.url for s in cell.shards]},
            }
            for index, cell in enumerate(cells)
        ]
    path = workdir / "api.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_cells(
    cells: int, images: int, shards: int, clients: int, workdir: Path, instructions: bool = False, pin: bool = False
) -> dict[str, Any]:
    """The four phases over `cells` cells (one: today's deployment, no `cells` setting), `images` a cell
    (`instructions`: each cell's Redis under callgrind, its instructions counted too; `pin`: each cell's Redis
    main thread on a core of its own, the first cell's on CPU 0, as far as the machine has cores)."""
    workdir.mkdir(parents=True, exist_ok=True)
    total_images = images * cells
    cores = sorted(os.sched_getaffinity(0))
    started = [
        PlaneCell.start(
            workdir / f"cell-{CELL_NAMES[index]}",
            shards,
            total_images,
            instructions,
            cores[index % len(cores)] if pin else None,
        )
        for index in range(cells)
    ]
    api_config_path = _api_config(started, total_images, workdir)
    servers = [cell.server for cell in started]
    shard_servers = [cell.shards for cell in started]
    configs = [cell.config for cell in started]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("IMGSERVE_REDIS_URL", "PROMETHEUS_MULTIPROC_DIR", "IMGSERVE_CELLS"):
        base_env.pop(name, None)
    processes: list[ManagedProcess] = []
    redis_clients = [redis.Redis.from_url(s.url) for s in servers]
    bulk_clients = [[redis.Redis.from_url(s.url) for s in own] for own in shard_servers]
    payloads = tiny_jpegs(total_images)
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=clients * cells))
    pids = [server.process.pid for server in servers]
    meter = CellsMeter(redis_clients, pids, [cell.counter for cell in started if cell.counter])

    def spawn(name: str, argv: list[str], config: Path, more: dict[str, str] | None = None) -> None:
        env = {**base_env, "IMGSERVE_CONFIG": str(config), **(more or {})}
        processes.append(ManagedProcess(name, argv, env, workdir))

    try:
        spawn("api", api_argv(), api_config_path, api_env(port, cells, 64))  # the API tier grows with the cells
        wait_until(lambda: api_answers(url + "/healthz", processes), 60, interval_s=0.2, what="the API")

        def submit(payload: bytes) -> str:
            reply = session.post(url + "/v1/jobs", data=payload, headers={"Content-Type": "image/jpeg"}, timeout=30)
            if reply.status_code != 202:
                raise RuntimeError(f"submit answered {reply.status_code}: {reply.text[:300]}")
            return str(reply.json()["id"])

        with ThreadPoolExecutor(clients * cells) as pool:
            ids = meter.measure("intake", lambda: list(pool.map(submit, payloads)))
            taken = _taken(ids, cells)

            def cpu_phase() -> None:  # cell by cell: see the module's docstring
                for index, config in enumerate(configs):
                    spawn(f"cpu-worker-{CELL_NAMES[index]}", cpu_worker_argv(2), config)
                    keys, models = _keys_and_models(config)
                    waiting = Progress(bulk_clients[index] or [redis_clients[index]], [keys.frames(m) for m in models])
                    wait_until(_at_least(waiting.frames_waiting, taken[index]), 300, interval_s=0.2, what="frames")

            meter.measure("cpu", cpu_phase)

            def gpu_phase() -> None:
                for index, config in enumerate(configs):
                    spawn(f"gpu-worker-{CELL_NAMES[index]}", gpu_worker_argv("sim", f"plane-gpu-{index}"), config)
                    # every job of the cell ended: out of its deadline index (as bench plane's gpu step)
                    deadlines, cell_redis = _keys_and_models(config)[0].deadlines, redis_clients[index]
                    wait_until(_none_left(cell_redis, deadlines), 300, interval_s=0.2, what="every job ended")

            meter.measure("gpu", gpu_phase)

            def read(job_id: str) -> str:
                return str(session.get(f"{url}/v1/jobs/{job_id}", timeout=30).json()["status"])

            statuses = meter.measure("read", lambda: list(pool.map(read, ids)))
        idle = meter.idle(3.0)
    finally:
        for process in reversed(processes):
            process.stop()
        for cell in started:
            cell.stop()
    per_cell = []
    for index in range(cells):
        phases = meter.net(index, taken[index], idle[index])
        threads = [meter.threads[phase][index] for phase in PHASES]
        per_cell.append(
            {
                "images": taken[index],
                "phases": phases,
                "total": total_cost([phases[p] for p in PHASES]),
                "main_thread": per_image(threads, taken[index]),
            }
        )
    return {
        "cells": cells,
        "images": total_images,
        "ended": {status: statuses.count(status) for status in set(statuses)},
        "per_cell": per_cell,
        "idle_per_s": idle,
        "seconds": dict(meter.seconds),
    }


def _at_least(read: Callable[[], int], count: int) -> Callable[[], bool]:
    return lambda: read() >= count


def _taken(ids: list[str], cells: int) -> list[int]:
    """How many of the jobs each cell took (the cell its id names)."""
    taken = [0] * cells
    for job_id in ids:
        taken[JobIds.cell_of(job_id) if cells > 1 else 0] += 1
    return taken


def run(
    cells: int, images: int, shards: int, clients: int, instructions: bool = False, pin: bool = False
) -> tuple[str, dict[str, Any]]:
    """One cell, then `cells` cells, in one run."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-plane-cells-"))
    try:
        one = run_cells(1, images, shards, clients, scratch / "one", instructions, pin)
        many = run_cells(cells, images, shards, clients, scratch / "many", instructions, pin)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report(one, many), {"one": one, "many": many, "verdict": verdict(one, many)}
