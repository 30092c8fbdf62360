"""Flower stops on SIGTERM within a bound, even while its broker does not answer: it had to be killed. Its thread
pool broadcasts every 5 s, and one in flight when Redis went retried the connection for minutes while the exit
waited on it (without the bound this test fails when the SIGTERM meets such a broadcast: two runs of three)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis
import requests

from bench.stack.processes import RedisServer, free_port, wait_until
from tests.support import REPO_ROOT

pytestmark = pytest.mark.integration


def test_flower_told_to_stop_while_redis_is_away_ends_by_itself(tmp_path):
    redis_server = RedisServer(tmp_path)
    port = free_port()
    env = {
        **os.environ,
        "IMGSERVE_REDIS_URL": redis_server.url,
        "FLOWER_BASIC_AUTH": "flower:test-flower-password-0123",
        "PYTHONPATH": str(REPO_ROOT),
    }
    log = tmp_path / "flower.log"
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tasks.flower", "flower", "--address=127.0.0.1", f"--port={port}"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )
    try:
        auth = ("flower", "test-flower-password-0123")

        def answers() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/healthcheck", auth=auth, timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_until(answers, 60, what="Flower to answer")
        client = redis.Redis(port=redis_server.port)
        calls = [-1]

        def quiet() -> bool:
            """Flower's start-up calls made (its pool's connections open), none since the last look."""
            stats = client.info("commandstats")
            now = sum(stat["calls"] for name, stat in stats.items() if name != "cmdstat_info")
            still, calls[0] = now == calls[0], now
            return still and now > 0

        wait_until(quiet, 30, interval_s=0.5, what="Flower's start-up calls to Redis to end")
        redis_server.stop()
        # Its pool's next broadcast meets the dead broker and retries it without end; its events thread says each
        # time it tries again.
        wait_until(lambda: "trying again in 8 seconds" in log.read_text(), 30, what="Flower to miss its broker")
        stopped_at = time.monotonic()
        flower.send_signal(signal.SIGTERM)
        assert flower.wait(20) == 0, log.read_text()[-2000:]
        print(f"Flower ended {time.monotonic() - stopped_at:.1f} s after SIGTERM")
    finally:
        if flower.poll() is None:
            os.killpg(flower.pid, signal.SIGKILL)
            flower.wait()
