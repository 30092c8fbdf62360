"""Put a Redis backup back where an append-only Redis (make run's, compose's, a host's) will load it.

    python -m tools.restore BACKUP [--dir var/redis] [--namespace imgserve]

BACKUP is either an RDB snapshot (`redis-cli --rdb backup.rdb`, a `dump.rdb`) or a copy of a Redis 7
`appendonlydir` (the folder, its manifest inside). Every deployment here runs Redis with `--appendonly yes`, and
such a Redis loads its append-only file and never a `dump.rdb` beside it: a snapshot dropped into the data folder
as `dump.rdb` comes up empty. So a snapshot is loaded by a redis-server of this command's own (appendonly no, on
a free loopback port, in a folder of its own), which then turns the append-only file on and rewrites it from the
data; an append-only copy is taken as it is. Either way the result, an `appendonlydir`, replaces the one in
`--dir`, whatever was there is kept aside in `--dir/before-restore-<time>/`, and a redis-server started there as
make run starts it (appendonly yes) must hold as many keys as the backup did, or the command fails.

It refuses while a redis-server runs in `--dir` (its files would be overwritten under it, and its next rewrite or
shutdown would write its own state back over the restore): stop the service and its Redis first (docs/backup.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from contract.redis.keys import Keys
from tools.ports import free_port

AOF_FOLDER = "appendonlydir"
RDB_MAGIC = b"REDIS"
START_WAIT_S = 60.0  # a large backup takes a while to load
REWRITE_WAIT_S = 600.0
LASTING_MS = 60_000  # a key with less than this to live may expire during the restore: not checked


class RestoreError(Exception):
    """Said in one line, and the command exits 1."""


@dataclass(frozen=True)
class Restored:
    keys: int
    jobs: int
    kind: str  # "RDB snapshot" or "append-only copy"


def backup_kind(backup: Path) -> str:
    """ "rdb" or "aof"; anything else is refused with what was expected."""
    if backup.is_dir():
        if not any(backup.glob("*.manifest")):
            raise RestoreError(f"{backup} is a folder without a manifest: not a copy of a Redis 7 appendonlydir")
        return "aof"
    if not backup.is_file():
        raise RestoreError(f"{backup}: no such file or folder")
    with backup.open("rb") as file:
        if file.read(len(RDB_MAGIC)) != RDB_MAGIC:
            raise RestoreError(f"{backup} is neither an RDB snapshot (it starts with REDIS) nor an appendonlydir")
    return "rdb"


def redis_running_in(folder: Path) -> list[int]:
    """Pids of the redis-server processes whose working folder is `folder` (redis-server runs in its --dir)."""
    wanted = folder.resolve()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().strip().startswith("redis-server"):
                continue
            if Path(os.readlink(entry / "cwd")).resolve() == wanted:
                pids.append(int(entry.name))
        except OSError:  # gone, or another user's: not readable
            continue
    return pids


class _Server:
    """A redis-server of this command's own on a loopback port: stopped without writing a snapshot."""

    def __init__(self, folder: Path, *options: str) -> None:
        self.folder = folder
        self.port = free_port()
        self.log = folder / "restore-redis.log"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(folder)]
            + ["--logfile", str(self.log), *options],
            stdin=subprocess.DEVNULL,
        )
        self.client = redis.Redis(port=self.port, socket_timeout=30)
        deadline = time.monotonic() + START_WAIT_S
        while True:
            try:
                if self.client.ping():
                    return
            except redis.BusyLoadingError:
                pass
            except redis.ConnectionError:
                if self.process.poll() is not None:
                    raise RestoreError(f"redis-server would not load it; its log ends:\n{self._log_tail()}") from None
            if time.monotonic() > deadline:
                self.stop()
                tail = self._log_tail()
                raise RestoreError(f"redis-server did not answer in {START_WAIT_S:g} s; its log ends:\n{tail}")
            time.sleep(0.1)

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-10:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SHUTDOWN NOSAVE: the append-only file is flushed, no dump.rdb is written."""
        try:
            self.client.shutdown(nosave=True)
        except redis.RedisError:
            self.process.terminate()
        self.process.wait(30)
        self.log.unlink(missing_ok=True)


def _count(client: redis.Redis, namespace: str) -> tuple[int, int]:
    jobs = sum(1 for _ in client.scan_iter(match=Keys(namespace).job("*"), count=1000))
    return int(client.dbsize()), jobs


def _lasting_keys(client: redis.Redis) -> set[bytes]:
    """The keys that outlive the restore: heartbeats, leases and locks (a TTL of seconds) may expire between the
    load and the check, and a Redis drops them at its next load anyway."""
    lasting: set[bytes] = set()
    batch: list[bytes] = []

    def flush() -> None:
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.pttl(key)
        lasting.update(key for key, ttl in zip(batch, pipe.execute()) if ttl == -1 or ttl > LASTING_MS)
        batch.clear()

    for key in client.scan_iter(count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            flush()
    flush()
    return lasting


def _missing(client: redis.Redis, keys: set[bytes]) -> list[bytes]:
    ordered = sorted(keys)
    missing = []
    for start in range(0, len(ordered), 1000):
        chunk = ordered[start : start + 1000]
        pipe = client.pipeline(transaction=False)
        for key in chunk:
            pipe.exists(key)
        missing += [key for key, found in zip(chunk, pipe.execute()) if not found]
    return missing


def _rewrite_aof_from_rdb(backup: Path, staging: Path) -> set[bytes]:
    """Load the snapshot with the append-only file off, turn it on (Redis then writes a new one from the data) and
    wait for that rewrite to end: the lasting keys it held."""
    shutil.copyfile(backup, staging / "dump.rdb")
    server = _Server(staging, "--appendonly", "no", "--dbfilename", "dump.rdb")
    try:
        keys = _lasting_keys(server.client)
        server.client.config_set("appendonly", "yes")
        deadline = time.monotonic() + REWRITE_WAIT_S
        while True:
            info = server.client.info("persistence")
            done = info["aof_enabled"] == 1 and not info["aof_rewrite_in_progress"]
            if done and not info["aof_rewrite_scheduled"]:
                if info.get("aof_last_bgrewrite_status") != "ok":
                    tail = server._log_tail()
                    raise RestoreError(f"the append-only rewrite failed; redis-server's log ends:\n{tail}")
                break
            if time.monotonic() > deadline:
                raise RestoreError(f"the append-only rewrite did not end in {REWRITE_WAIT_S:g} s")
            time.sleep(0.1)
    finally:
        server.stop()
    (staging / "dump.rdb").unlink()
    return keys


def _keys_in_aof(staging: Path) -> set[bytes]:
    server = _Server(staging, "--appendonly", "yes")
    try:
        return _lasting_keys(server.client)
    finally:
        server.stop()


def restore(backup: Path, folder: Path, namespace: str = "imgserve", say: Callable[[str], None] = print) -> Restored:
    """Restore `backup` into `folder` (see the module's docstring); what a Redis started there as make run starts
    it holds."""
    # Absolute: redis-server resolves its --logfile and the loaded files after moving into its --dir.
    backup, folder = backup.resolve(), folder.resolve()
    kind = backup_kind(backup)
    live = redis_running_in(folder) if folder.exists() else []
    if live:
        raise RestoreError(
            f"a redis-server runs in {folder} (pid {', '.join(map(str, live))}): stop it (and the service) first; "
            "restoring under it would be undone by its next write of the append-only file"
        )
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="restore-", dir=folder) as work:
        staging = Path(work)
        if kind == "rdb":
            expected = _rewrite_aof_from_rdb(backup, staging)
        else:
            shutil.copytree(backup, staging / AOF_FOLDER)
            expected = _keys_in_aof(staging)
        kept = [folder / name for name in (AOF_FOLDER, "appendonly.aof", "dump.rdb") if (folder / name).exists()]
        if kept:
            aside = folder / f"before-restore-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
            aside.mkdir()
            for path in kept:
                path.rename(aside / path.name)
            say(f"restore: kept what {folder} held before in {aside}")
        (staging / AOF_FOLDER).rename(folder / AOF_FOLDER)
    # As make run starts it: the append-only file only.
    server = _Server(folder, "--appendonly", "yes")
    try:
        keys, jobs = _count(server.client, namespace)
        missing = _missing(server.client, expected)
    finally:
        server.stop()
    if missing:
        raise RestoreError(
            f"the restored Redis lacks {len(missing)} of the backup's {len(expected)} lasting keys, e.g. {missing[0]!r}"
        )
    what = "RDB snapshot" if kind == "rdb" else "append-only copy"
    say(f"restore: {folder / AOF_FOLDER} holds the {what} {backup}: {keys} keys, {jobs} job records")
    return Restored(keys, jobs, what)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.restore", description=__doc__.splitlines()[0])
    parser.add_argument("backup", type=Path, help="an RDB snapshot, or a copy of an appendonlydir")
    parser.add_argument(
        "--dir", type=Path, default=Path("var/redis"), help="the Redis data folder to restore into (make run's)"
    )
    parser.add_argument("--namespace", default="imgserve", help="the service's key prefix, for the count of jobs")
    args = parser.parse_args(argv)
    try:
        restore(args.backup, args.dir, args.namespace)
    except RestoreError as error:
        print(f"restore: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
