"""A local Redis with failover: a primary, two replicas and three Sentinels, real `redis-server` processes.

    python -m tools.redis_ha start --dir var/redis-ha   # prints the settings' variables, as shell assignments
    python -m tools.redis_ha stop --dir var/redis-ha

What `make run REDIS=sentinel` runs (scripts/run-local), and what the failover tests and `bench chaos
--scenario failover` kill. Each server is its own session (a terminal's Ctrl-C is not theirs); their pids
are in the folder, and `stop` shuts them down. The folder is emptied at each start: a playground for failover,
whose data does not outlive the run (both servers keep an append-only file while it runs, fsynced every second,
as a production pair would).

Two replicas, so that a 202 (which waits until one replica holds the job: settings.redis.min_replicas) can be
given while the old primary is away: after a failover the new primary has the other replica. With one replica,
every submission would be refused (503 not-replicated) until the old primary came back.

Sentinel's `down-after-milliseconds` is DOWN_AFTER_MS: the primary silent that long is taken for down, and a
failover follows within about a second (two of three Sentinels agree, one is elected and promotes the replica).
Lower finds a dead primary sooner; the cost is a failover for a primary that was only slow that long (a
fork for a rewrite of its append-only file on a busy host, a long script).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tools.ports import free_port
from tools.redis_config import redis_config_args

SERVICE = "imgserve"
SERVERS, REPLICAS = ("a", "b", "c"), ("b", "c")
DOWN_AFTER_MS = 1500
FAILOVER_TIMEOUT_MS = 10_000
START_LIMIT_S = 30.0
# The append-only file as make run's and compose's Redis keep it: fsynced every second, rewritten at 512 MB, not
# Redis's 64 (every upload passes through it: docs/reliability.md)
AOF_AS_DEPLOYED = ("--appendonly", "yes", "--appendfsync", "everysec", "--auto-aof-rewrite-min-size", "512mb")
# The control plane's settings beyond Redis's defaults, every deployment's (make run starts its Redis with them too)
AS_CONFIGURED = tuple(redis_config_args(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Place:
    """Where a node runs: the address the others reach it at (and it binds), its port (0: a free one on this
    machine), and what its command line is run under (bench.stack.hosts: `ip netns exec <host>`)."""

    address: str = "127.0.0.1"
    port: int = 0
    prefix: tuple[str, ...] = ()


HERE = Place()


@dataclass
class Node:
    name: str
    port: int
    argv: list[str]
    pid: int = 0
    host: str = "127.0.0.1"

    def alive(self) -> bool:
        if not self.pid:
            return False
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"


@dataclass
class RedisHA:
    """The six processes in `folder`: servers `a` (the primary at the start), `b` and `c` (its replicas), and
    the Sentinels s1-s3."""

    folder: Path
    service: str = SERVICE
    password: str = ""  # the servers' requirepass (and the Sentinels' auth-pass); none: ""
    down_after_ms: int = DOWN_AFTER_MS
    nodes: dict[str, Node] = field(default_factory=dict)
    # Where each node runs (by name: a, b, c, s1-s3); this machine's loopback for any not named. A node placed
    # elsewhere binds its address with protected mode off (reachable from other hosts without a password).
    places: dict[str, Place] = field(default_factory=dict)

    # --- start and stop -----------------------------------------------------------------------------------

    def start(self) -> RedisHA:
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.glob("*"):
            if old.is_dir():
                for item in old.iterdir():
                    item.unlink()
            else:
                old.unlink()
        primary = self._place("a")
        self._server("a", [])
        for name in REPLICAS:
            self._server(name, ["--replicaof", primary.address, str(self.nodes["a"].port)])
        # The Sentinels after the replicas are linked: they learn the replicas from the primary's INFO, at once
        # when they first connect, else only every 10 s, and cannot fail over to a replica they do not know.
        self._until(lambda: self._replicas_linked("a") >= len(REPLICAS), START_LIMIT_S, "the replicas to link")
        for name in ("s1", "s2", "s3"):
            self._sentinel(name, primary.address, self.nodes["a"].port)
        self._save()
        self.wait_settled(START_LIMIT_S)
        self._until(self._replicas_known, START_LIMIT_S, "the Sentinels to know both replicas")
        return self

    def _until(self, condition: Any, limit_s: float, what: str) -> None:
        deadline = time.monotonic() + limit_s
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis set in {self.folder}: waited {limit_s:g} s for {what}")
            time.sleep(0.05)

    def _replicas_known(self) -> bool:
        """Every Sentinel lists both replicas (it could fail over to either)."""
        try:
            return all(
                len(self._ask(name).sentinel_slaves(self.service)) >= len(REPLICAS) for name in ("s1", "s2", "s3")
            )
        except redis.RedisError:
            return False

    def _place(self, name: str) -> Place:
        return self.places.get(name, HERE)

    def _port(self, name: str) -> int:
        return self._place(name).port or free_port()

    def _exposure(self, name: str) -> list[str]:
        """How a node placed on another host opens itself to the others (loopback stays protected)."""
        address = self._place(name).address
        return [] if address == HERE.address else ["--protected-mode", "no"]

    def _server(self, name: str, extra: list[str]) -> None:
        home = self.folder / name
        home.mkdir(exist_ok=True)
        port = self._port(name)
        auth = ["--requirepass", self.password, "--masterauth", self.password] if self.password else []
        argv = [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            self._place(name).address,
            *self._exposure(name),
            "--dir",
            str(home),
            "--save",
            "",
            *AOF_AS_DEPLOYED,
            *AS_CONFIGURED,
            "--logfile",
            str(home / "redis.log"),
            *auth,
            *extra,
        ]
        self._spawn(Node(name, port, argv, host=self._place(name).address))

    def _sentinel(self, name: str, primary_host: str, primary_port: int) -> None:
        home = self.folder / name
        home.mkdir(exist_ok=True)
        config = home / "sentinel.conf"  # Sentinel rewrites it with what it learns: its own file
        port = self._port(name)
        lines = [
            f"port {port}",
            f"bind {self._place(name).address}",
            *(["protected-mode no"] if self._exposure(name) else []),
            f"dir {home}",
            f"logfile {home / 'sentinel.log'}",
            f"sentinel monitor {self.service} {primary_host} {primary_port} 2",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {self.service} 1",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {self.service} {self.password}")
        config.write_text("\n".join(lines) + "\n")
        self._spawn(Node(name, port, ["redis-server", str(config), "--sentinel"], host=self._place(name).address))

    def _spawn(self, node: Node) -> None:
        place = self._place(node.name)
        process = subprocess.Popen(
            [*place.prefix, *node.argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        node.pid = process.pid
        self.nodes[node.name] = node

    def _save(self) -> None:
        state = {name: {"port": n.port, "argv": n.argv, "pid": n.pid, "host": n.host} for name, n in self.nodes.items()}
        (self.folder / "nodes.json").write_text(json.dumps({"service": self.service, "nodes": state}, indent=1))

    @classmethod
    def load(cls, folder: Path) -> RedisHA:
        saved = json.loads((folder / "nodes.json").read_text())
        ha = cls(folder, service=saved["service"])
        ha.nodes = {
            name: Node(name, n["port"], n["argv"], n["pid"], n.get("host", HERE.address))
            for name, n in saved["nodes"].items()
        }
        return ha

    def stop(self) -> None:
        """Sentinels first (no failover for a primary that is only being stopped), then the servers."""
        for name in ("s1", "s2", "s3", *reversed(SERVERS)):
            node = self.nodes.get(name)
            if node is not None and node.alive():
                os.kill(node.pid, signal.SIGTERM)  # redis-server: SHUTDOWN, its append-only file written out
        deadline = time.monotonic() + 15
        while any(n.alive() for n in self.nodes.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for node in self.nodes.values():
            if node.alive():
                os.kill(node.pid, signal.SIGKILL)

    # --- what tests and chaos do --------------------------------------------------------------------------

    @property
    def sentinels(self) -> list[str]:
        return [f"{self.nodes[name].host}:{self.nodes[name].port}" for name in ("s1", "s2", "s3")]

    def env(self) -> dict[str, str]:
        """The variables that point every process at this set (contract.settings.config's names)."""
        return {
            "IMGSERVE_REDIS__SENTINELS": "[" + ", ".join(self.sentinels) + "]",
            "IMGSERVE_REDIS__SERVICE": self.service,
        }

    def _ask(self, name: str, password: str = "") -> redis.Redis:
        node = self.nodes[name]
        return redis.Redis(
            host=node.host, port=node.port, password=password or None, socket_timeout=2, socket_connect_timeout=2
        )

    def primary(self) -> str | None:
        """Which server (a, b or c) a majority of the live Sentinels name the primary now."""
        votes: dict[tuple[str, int], int] = {}
        for name in ("s1", "s2", "s3"):
            try:
                address: Any = self._ask(name).sentinel_get_master_addr_by_name(self.service)
            except redis.RedisError:
                continue
            if address:  # (host, port), or None before it knows
                host = address[0].decode() if isinstance(address[0], bytes) else str(address[0])
                key = (host, int(address[1]))
                votes[key] = votes.get(key, 0) + 1
        for node in (self.nodes[name] for name in SERVERS):
            if votes.get((node.host, node.port), 0) >= 2:
                return node.name
        return None

    def role(self, name: str) -> str | None:
        """What the server itself says it is (master / slave), or None when it does not answer."""
        try:
            reply = self._ask(name, self.password).execute_command("ROLE")
        except redis.RedisError:
            return None
        role = reply[0]
        return role.decode() if isinstance(role, bytes) else str(role)

    def wait_settled(self, limit_s: float) -> str:
        """Until the Sentinels agree on a primary that says it is one, and every other live server is linked to
        it as its replica: the primary's name."""
        deadline = time.monotonic() + limit_s
        while True:
            primary = self.primary()
            if primary is not None and self.role(primary) == "master":
                others = sum(1 for name in SERVERS if name != primary and self.nodes[name].alive())
                if self._replicas_linked(primary) >= others:
                    return primary
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis set in {self.folder} did not settle within {limit_s:g} s")
            time.sleep(0.1)

    def _replicas_linked(self, primary: str) -> int:
        """How many replicas the primary streams to (state online)."""
        try:
            info = self._ask(primary, self.password).info("replication")
        except redis.RedisError:
            return 0
        return sum(
            1
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
        )

    def kill_primary(self) -> str:
        """SIGKILL the server the Sentinels name the primary (a machine lost): its name."""
        primary = self.primary()
        if primary is None:
            raise RuntimeError("no primary to kill: the Sentinels agree on none")
        os.kill(self.nodes[primary].pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.nodes[primary].alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return primary

    def restart(self, name: str) -> None:
        """Start a stopped server again with its first command line: the Sentinels turn a former primary into a
        replica of the new one (its own stale data replaced by a full copy)."""
        node = self.nodes[name]
        if node.alive():
            raise RuntimeError(f"{name} is running")
        self._spawn(Node(name, node.port, node.argv, host=node.host))
        self._save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.redis_ha", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--dir", type=Path, default=Path("var/redis-ha"))
    args = parser.parse_args(argv)
    if args.action == "start":
        ha = RedisHA(args.dir.resolve()).start()
        for key, value in ha.env().items():
            print(f"export {key}='{value}'")
        print(
            f"# primary {ha.primary()}: " + ", ".join(f"{n.name} {n.port}" for n in ha.nodes.values()), file=sys.stderr
        )
        return 0
    if not (args.dir / "nodes.json").exists():
        print(f"no Redis set in {args.dir}", file=sys.stderr)
        return 1
    ha = RedisHA.load(args.dir.resolve())
    if args.action == "stop":
        ha.stop()
    else:
        print(json.dumps({"primary": ha.primary(), "alive": {n.name: n.alive() for n in ha.nodes.values()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
