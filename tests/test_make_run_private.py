"""`make run REDIS=private` as a reader runs it, from a copy of the checkout (its data in the copy's var/redis, not
this checkout's): the Redis port chosen with REDIS_PORT, a Redis that dies started again on its data, the ready
line naming what signs callbacks when API keys sign with their own secrets, and a SIGTERM that stops everything
and ends with 0."""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests
import yaml

from bench.stack.processes import REPO_ROOT, ManagedProcess, children_of, free_port, wait_until
from tests.test_make_run import listening_addresses
from tools.newcomer_check import copy_checkout, newcomer_env

API_KEY = "make-run-private-test-key-0123456789"
KEY_SECRET = "team-a-callback-secret-0123456789abcdef"


@dataclass
class PrivateRun:
    root: Path
    process: ManagedProcess
    redis_port: int
    api_url: str

    def log(self) -> str:
        return self.process.log_tail(200_000)


@pytest.fixture(scope="module")
def private_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRun]:
    root = tmp_path_factory.mktemp("make-run-private") / "imgserve"
    root.mkdir()
    copy_checkout(REPO_ROOT, root, fresh_venv=False)
    digest = hashlib.sha256(API_KEY.encode()).hexdigest()
    (root / "my.yaml").write_text(
        yaml.safe_dump(
            {
                "gpu_worker": {"device": "sim"},
                "auth": {"api_keys": [{"id": "team-a", "sha256": digest, "callback_secret_env": "TEAM_A_SECRET"}]},
            }
        )
    )
    api_port, redis_port = free_port(), free_port()
    env = {
        **newcomer_env(root, api_port, free_port(), free_port()),
        "REDIS": "private",
        "REDIS_PORT": str(redis_port),
        "IMGSERVE_CONFIG": str(root / "my.yaml"),
        "TEAM_A_SECRET": KEY_SECRET,
        "CPU_WORKERS": "1",
    }
    process = ManagedProcess("make-run", [str(root / "scripts" / "run-local")], env, root.parent, root=root)
    run = PrivateRun(root, process, redis_port, f"http://127.0.0.1:{api_port}")
    try:
        wait_until(lambda: "make run: ready at" in run.log() or not process.alive(), 240, what="make run's ready line")
        assert process.alive(), run.log()[-5000:]
        yield run
    finally:
        process.stop(timeout_s=60)


def test_the_ready_line_names_each_api_keys_own_secret_not_one_that_signs_nothing(private_run):
    log = private_run.log()
    assert "Callbacks (callback_url=...): signed with each API key's own secret (team-a: $TEAM_A_SECRET)" in log, log
    assert "var/callback-secret" not in log


def test_redis_private_listens_on_the_port_chosen(private_run):
    assert listening_addresses(private_run.redis_port) == {"127.0.0.1"}
    assert f"Redis redis://127.0.0.1:{private_run.redis_port}/0 (its own, REDIS=private" in private_run.log()
    assert redis.Redis(port=private_run.redis_port).ping()
    # with configs/redis.conf, as every deployment's control plane
    limit = redis.Redis(port=private_run.redis_port, decode_responses=True).config_get("hash-max-listpack-entries")
    assert limit == {"hash-max-listpack-entries": "0"}
    assert redis.Redis(port=private_run.redis_port).info("server")["config_file"] == ""  # options, not the file


def test_a_killed_redis_is_started_again_on_its_port_and_data(private_run):
    client = redis.Redis(port=private_run.redis_port)
    client.set("make-run-private:marker", "kept")
    killed = int(client.info("server")["process_id"])
    os.kill(killed, signal.SIGKILL)
    wait_until(lambda: "redis-server started again" in private_run.log(), 60, what="make run to start Redis again")
    assert f"the redis-server it started (pid {killed}) ended (status 137)" in private_run.log()
    assert client.get("make-run-private:marker") == b"kept"  # from var/redis's append-only file
    assert int(client.info("server")["process_id"]) != killed
    headers = {"Authorization": f"Bearer {API_KEY}"}
    wait_until(
        lambda: requests.get(f"{private_run.api_url}/readyz", timeout=5).status_code == 200, 60, what="ready again"
    )
    response = requests.post(
        f"{private_run.api_url}/v1/jobs?wait=20",
        files={"image": (REPO_ROOT / "samples" / "shapes-3.jpg").read_bytes()},
        headers=headers,
        timeout=30,
    )
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text


def _descendants(pid: int) -> set[int]:
    found, frontier = set(), {pid}
    while frontier:
        frontier = set().union(*(children_of(p) for p in frontier)) - found
        found |= frontier
    return found


def test_sigterm_stops_every_process_and_redis_and_ends_with_0(private_run):
    """Last in this file: it ends the run. A service manager's stop (a SIGTERM to make run's script)."""
    every = _descendants(private_run.process.process.pid)
    assert len(every) >= 6, every  # Redis, the supervisor and its processes
    os.kill(private_run.process.process.pid, signal.SIGTERM)
    assert private_run.process.process.wait(60) == 0, private_run.log()[-3000:]
    left = [pid for pid in every if _live(pid)]
    assert not left, left
    assert "stopped the redis-server it started" in private_run.log()
    assert not listening_addresses(private_run.redis_port)


def _live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
