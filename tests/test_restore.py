"""Both backups docs/backup.md names, taken while jobs run, put back by tools.restore into a fresh data folder,
loaded by a Redis started as make run starts it (append-only), and read through the API. A snapshot copied in as
`dump.rdb` came up empty under `--appendonly yes`: such a Redis loads its append-only file only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import redis
import requests
import yaml

from bench.stack.processes import RedisServer
from contract.settings.config import load_settings
from tests.support import REPO_ROOT, ApiServer, jpeg
from tools.redis_ha import AOF_AS_DEPLOYED


def run_restore(backup: Path, folder: Path, namespace: str) -> subprocess.CompletedProcess:
    """As the docs run it: from the folder above the data folder, which is named relative to it (var/redis)."""
    return subprocess.run(
        [sys.executable, "-m", "tools.restore", str(backup), "--dir", folder.name, "--namespace", namespace],
        cwd=folder.parent,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_snapshot_and_an_append_only_copy_taken_under_load_restore_every_ended_job(own_redis_stack, tmp_path):
    stack, server = own_redis_stack
    ended = [stack.submit_ok(jpeg(96, 64, seed=seed)) for seed in range(5)]
    documents = {job_id: stack.wait_terminal(job_id) for job_id in ended}
    assert all(doc["status"] == "succeeded" for doc in documents.values())
    running = [stack.submit_ok(jpeg(96, 64, seed=seed)) for seed in range(5, 15)]  # the load under the backups
    snapshot = tmp_path / "backup.rdb"
    subprocess.run(["redis-cli", "-p", str(server.port), "--rdb", str(snapshot)], check=True, capture_output=True)
    aof_copy = tmp_path / "appendonlydir-copy"
    shutil.copytree(server.workdir / "appendonlydir", aof_copy)
    for job_id in running:
        stack.wait_terminal(job_id)

    for backup, kind in ((snapshot, "RDB snapshot"), (aof_copy, "append-only copy")):
        folder = tmp_path / f"restored-from-{backup.name}"
        result = run_restore(backup, folder, stack.settings.namespace)
        assert result.returncode == 0, result.stderr
        assert f"holds the {kind}" in result.stdout and "job records" in result.stdout, result.stdout
        assert sorted(path.name for path in folder.iterdir()) == ["appendonlydir"]  # no dump.rdb to mislead
        restored = RedisServer(folder, extra_args=AOF_AS_DEPLOYED)  # as make run starts it: the AOF is all it reads
        try:
            reported = int(re.search(r": (\d+) keys, (\d+) job records", result.stdout).group(1))
            # As many, less the keys of seconds' life (heartbeats, leases) that expired since the restore said it
            assert 0 < redis.Redis(port=restored.port).dbsize() <= reported
            config = yaml.safe_load(stack.config_path.read_text())
            config["redis_url"] = restored.url
            config_path = tmp_path / f"config-{backup.name}.yaml"
            config_path.write_text(yaml.safe_dump(config))
            from app import create_app

            api = ApiServer(create_app(load_settings(config_path)))
            try:
                for job_id, before in documents.items():
                    after = requests.get(f"{api.url}/v1/jobs/{job_id}", timeout=10)
                    assert after.status_code == 200, (kind, after.text)
                    assert after.json()["status"] == "succeeded"
                    assert after.json()["result"] == before["result"], kind
            finally:
                api.stop()
        finally:
            restored.stop()


def test_a_restore_into_the_folder_of_a_running_redis_is_refused_and_touches_nothing(redis_server, tmp_path):
    (tmp_path / "live").mkdir()
    live = RedisServer(tmp_path / "live", extra_args=AOF_AS_DEPLOYED)
    try:
        redis.Redis(port=live.port).set("kept", "1")
        before = sorted(path.name for path in (tmp_path / "live" / "appendonlydir").iterdir())
        snapshot = tmp_path / "backup.rdb"
        backup = ["redis-cli", "-p", str(redis_server.port), "--rdb", str(snapshot)]
        subprocess.run(backup, check=True, capture_output=True)
        result = run_restore(snapshot, tmp_path / "live", "imgserve")
        assert result.returncode == 1
        assert f"a redis-server runs in {tmp_path / 'live'} (pid {live.process.pid})" in result.stderr, result.stderr
        assert sorted(path.name for path in (tmp_path / "live" / "appendonlydir").iterdir()) == before
        assert redis.Redis(port=live.port).get("kept") == b"1"
    finally:
        live.stop()


def test_what_is_not_a_backup_is_refused_in_one_line(tmp_path):
    stray = tmp_path / "notes.txt"
    stray.write_text("hello")
    result = run_restore(stray, tmp_path / "data", "imgserve")
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "neither an RDB snapshot" in result.stderr
    assert not (tmp_path / "data").exists()
