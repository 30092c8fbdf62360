"""bench.meters.redis_counts against a real primary and replica: what a run's writes cost the control plane per
image."""

from __future__ import annotations

import os
from pathlib import Path

import redis

from bench.meters.redis_counts import per_image, read_counts
from bench.stack.processes import RedisServer, wait_until


def test_commands_and_replication_bytes_per_image_are_counted_on_a_real_primary(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    primary = RedisServer(tmp_path / "a")
    replica = RedisServer(tmp_path / "b", extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    try:
        client = redis.Redis(port=primary.port)
        wait_until(lambda: client.info("replication")["connected_slaves"] == 1, 10, what="the replica to link")
        before = read_counts(primary.port)
        for i in range(10):  # ten "images": two writes and a read each, 4 KB written per image
            client.set(f"upload:{i}", b"x" * 4096)
            client.hset(f"job:{i}", "status", "queued")
            client.get(f"upload:{i}")
        after = read_counts(primary.port)
        counts = per_image(before, after, 10)
        assert counts is not None
        assert counts["top"]["set"] == 1 and counts["top"]["hset"] == 1 and counts["top"]["get"] == 1
        assert "info" not in counts["top"]  # reading the counts is not counted
        assert 4.0 <= counts["repl_kb"] < 4.5  # the 4 KB value and its command went into the stream once
        assert per_image(after, before, 10) is None  # a primary whose offset went back: a failover between them
        assert read_counts(None) is None
    finally:
        replica.stop()
        primary.stop()


def test_redis_cpu_includes_the_rewrites_it_forked_and_reaped(tmp_path: Path):
    # An append-only file's rewrite runs in a child Redis forks and reaps: its CPU lands in Redis's cutime and
    # cstime, which bench.stack.cpu counts for a redis-server (and for nothing else: prefork children are sampled
    # alive).
    from bench.stack.cpu import read_process

    # No rewrite of its own (150 MB is past the 64 MB that would start one): only the one asked for below.
    server = RedisServer(
        tmp_path, extra_args=("--appendonly", "yes", "--appendfsync", "no", "--auto-aof-rewrite-percentage", "0")
    )
    try:
        client = redis.Redis(port=server.port)
        for i in range(150):  # 150 MB for the rewrite to write out
            client.set(f"upload:{i}", bytes(1024 * 1024))
        client.bgrewriteaof()
        wait_until(
            lambda: (
                client.info("persistence")["aof_rewrite_in_progress"] == 0
                and client.info("persistence")["aof_rewrites"] >= 1
            ),
            30,
            what="the rewrite to end",
        )
        pid = server.process.pid
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        own, children = int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])
        read = read_process(pid)
        assert read is not None
        assert children > 0  # the rewrite's CPU, reaped
        assert round(read[2] * os.sysconf("SC_CLK_TCK")) >= own + children  # counters only grow
    finally:
        server.stop()
