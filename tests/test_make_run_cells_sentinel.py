"""`make run CELLS=2 REDIS=sentinel`, from a copy of the checkout: each cell a primary, two replicas and three
Sentinels of its own, its processes following its primary through them; a JPEG goes through; SIGINT stops every
process and both Redis sets."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator

import pytest
import redis
import requests

from bench.stack.processes import REPO_ROOT, wait_until
from contract.redis.keys import Keys
from tests.test_make_run_cells import CellsRun, _descendants, _live, cells_env, running_cells
from tools.newcomer_check import copy_checkout
from tools.redis_ha import RedisHA

pytestmark = pytest.mark.integration

SENTINEL_CELL_LINE = re.compile(
    r"^  cell ([a-z]): Redis through the Sentinels ([0-9.:,]+) \(var/redis-ha-cell-\1\), Flower at ", re.MULTILINE
)


@pytest.fixture(scope="module")
def sentinel_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CellsRun]:
    root = tmp_path_factory.mktemp("make-run-cells-sentinel") / "imgserve"
    root.mkdir()
    copy_checkout(REPO_ROOT, root, fresh_venv=False)
    env = {**cells_env(root), "REDIS": "sentinel"}
    try:
        with running_cells("make-run-cells-sentinel", root, env) as run:
            yield run
    finally:
        for name in ("a", "b"):  # whatever the test left (a failure before the stop): the sets are its own
            if (root / f"var/redis-ha-cell-{name}/nodes.json").exists():
                RedisHA.load(root / f"var/redis-ha-cell-{name}").stop()


def redis_sets(run: CellsRun) -> dict[str, RedisHA]:
    return {name: RedisHA.load(run.root / f"var/redis-ha-cell-{name}") for name in ("a", "b")}


def test_each_cell_follows_its_own_sentinels_to_its_own_primary(sentinel_run):
    printed = dict(SENTINEL_CELL_LINE.findall(sentinel_run.log()))
    assert sorted(printed) == ["a", "b"], sentinel_run.log()[-3000:]
    sets = redis_sets(sentinel_run)
    keys = Keys("imgserve")
    primaries = {}
    for name, ha in sets.items():
        assert printed[name].split(",") == list(ha.sentinels)
        primary = ha.primary()
        assert primary is not None, name
        primaries[name] = ha.nodes[primary].port
        client = redis.Redis(port=primaries[name])
        # the cell's GPU worker writes its heartbeat on its cell's primary: it found it through its Sentinels
        assert wait_until(lambda: client.zrange(keys.gpu_workers, 0, -1), 60, what=f"cell {name}'s GPU worker")
        assert wait_until(lambda: list(client.scan_iter(keys.cpu_heartbeat("*"))), 60, what=f"cell {name}'s Celery")
    assert primaries["a"] != primaries["b"]
    assert not set(sets["a"].sentinels) & set(sets["b"].sentinels)


def test_a_jpeg_goes_through_with_sentinels_in_each_cell(sentinel_run):
    response = requests.post(
        f"{sentinel_run.api_url}/v1/jobs?wait=30",
        files={"image": (REPO_ROOT / "samples" / "shapes-3.jpg").read_bytes()},
        timeout=40,
    )
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text


def test_sigint_stops_every_process_and_both_redis_sets(sentinel_run):
    """Last in this file: it ends the run."""
    sets = redis_sets(sentinel_run)
    servers = [node.pid for ha in sets.values() for node in ha.nodes.values()]
    assert len(servers) == 12 and all(_live(pid) for pid in servers)
    every = _descendants(sentinel_run.process.process.pid)
    os.kill(sentinel_run.process.process.pid, signal.SIGINT)
    assert sentinel_run.process.process.wait(60) == 0, sentinel_run.log()[-3000:]
    assert not [pid for pid in every | set(servers) if _live(pid)]
    assert sentinel_run.log().count("stopped the Redis set it started") == 2
