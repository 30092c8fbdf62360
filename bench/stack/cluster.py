"""The service as several hosts on one machine (bench.stack.hosts): each role on a host of its own, as a deployment
runs it, so that a partition, a dead host and a wrong clock can be made and watched.

The roles: the Redis primary and its two replicas (tools.redis_ha's a, b, c), three Sentinels, the API (gunicorn),
the CPU workers (one Celery worker a host) and the GPU worker (the sim device). `Layout` says which host each runs
on; two roles may share one (a replica on the primary's host). The client, the bench itself, runs in this
machine's own namespace and reaches the API at its host's address.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from bench.stack.hosts import Host, Network
from bench.stack.local import StackOptions
from bench.stack.processes import (
    ManagedProcess,
    api_argv,
    cpu_worker_argv,
    gpu_worker_argv,
    wait_until,
)
from tools.redis_ha import SERVERS, Place, RedisHA

API_PORT, REDIS_PORT, SENTINEL_PORT = 8000, 6379, 26379


@dataclass(frozen=True)
class Layout:
    """The host (a name) each role runs on. Redis's servers: a is the primary at the start, b and c replicas."""

    redis: tuple[str, str, str] = ("redis-a", "redis-b", "redis-c")
    sentinels: tuple[str, str, str] = ("sentinel-1", "sentinel-2", "sentinel-3")
    api: str = "api"
    cpu: tuple[str, ...] = ("cpu-1", "cpu-2")
    gpu: str = "gpu"

    def hosts(self) -> list[str]:
        """Every host, each once, in the order the roles are listed."""
        names = [*self.redis, *self.sentinels, self.api, *self.cpu, self.gpu]
        return list(dict.fromkeys(names))

    def roles(self) -> dict[str, str]:
        """Each role's host: redis-a/b/c, sentinel-1/2/3, api, cpu-1..., gpu."""
        return {
            **{f"redis-{name}": host for name, host in zip(SERVERS, self.redis)},
            **{f"sentinel-{i}": host for i, host in enumerate(self.sentinels, 1)},
            "api": self.api,
            **{f"cpu-{i}": host for i, host in enumerate(self.cpu, 1)},
            "gpu": self.gpu,
        }


@dataclass
class HostedStack:
    """The service on hosts of `network`, laid out by `layout`; `skew` moves a host's clock (seconds)."""

    workdir: Path
    network: Network
    options: StackOptions
    layout: Layout = field(default_factory=Layout)
    skew: dict[str, float] = field(default_factory=dict)
    ha: RedisHA | None = None
    url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    spawned: dict[str, tuple[Host, list[str]]] = field(default_factory=dict)  # role: where, what

    def host(self, name: str) -> Host:
        return self.network.hosts[name]

    def host_of(self, role: str) -> Host:
        """The host a role runs on (a role's name as Layout.roles gives it)."""
        return self.host(self.layout.roles()[role])

    def start(self) -> HostedStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in self.layout.hosts():
            self.network.add_host(name).skew_s = self.skew.get(name, 0.0)
        self.network.count_links()
        self.ha = RedisHA(self.workdir / "redis-ha", places=self._redis_places()).start()
        config = self.options.config("redis://redis:6379/0")  # with Sentinels, only the database counts
        config["redis"] = {"sentinels": self.ha.sentinels, "service": self.ha.service}
        config_path = self.workdir / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        api = self.host(self.layout.api)
        self.url = f"http://{api.address}:{API_PORT}"
        env = {
            **os.environ,
            "IMGSERVE_CONFIG": str(config_path),
            "IMGSERVE_API__BIND": f"{api.address}:{API_PORT}",
            "IMGSERVE_API__WORKERS": str(self.options.api_workers),
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("IMGSERVE_REDIS_URL", "PROMETHEUS_MULTIPROC_DIR", "IMGSERVE_API_BIND", "IMGSERVE_API_WORKERS"):
            env.pop(name, None)
        self.env = env
        for role, host_name in self.layout.roles().items():
            if role.startswith(("cpu-", "gpu", "api")):
                self.spawned[role] = (self.host(host_name), self._argv(role))
                self._spawn(role)
        wait_until(self._ready, 120, interval_s=0.3, what=f"the hosted stack at {self.url} to be ready")
        return self

    def _redis_places(self) -> dict[str, Place]:
        places: dict[str, Place] = {}
        ports: dict[str, int] = {}
        nodes = [*zip(SERVERS, self.layout.redis), *zip(("s1", "s2", "s3"), self.layout.sentinels)]
        for name, host_name in nodes:
            host = self.host(host_name)
            base = SENTINEL_PORT if name.startswith("s") else REDIS_PORT
            port = ports[f"{host_name}:{base}"] = ports.get(f"{host_name}:{base}", base - 1) + 1
            places[name] = Place(host.address, port, host.prefix)
        return places

    def _argv(self, role: str) -> list[str]:
        if role == "api":
            return api_argv(access_log=False)
        if role == "gpu":
            return gpu_worker_argv(self.options.device, "gpu-1")
        return cpu_worker_argv(self.options.cpu_workers or 1, "-n", f"{role}@%h", loglevel="INFO")

    def _spawn(self, role: str) -> ManagedProcess:
        host, argv = self.spawned[role]
        return host.spawn(role, argv, self.env, self.workdir, root=self.options.root)

    def _ready(self) -> bool:
        dead = [p for host in self.network.hosts.values() for p in host.processes if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} died:\n{dead[0].log_tail()}")
        try:
            return requests.get(self.url + "/readyz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    # --- faults that need the stack's knowledge ----------------------------------------------------------------

    def kill_host(self, name: str) -> list[str]:
        """Every process on host `name` SIGKILLed at once: the roles it ran."""
        host = self.host(name)
        host.kill()
        return self.roles_on(name)

    def restart_host(self, name: str) -> None:
        """Start again what host `name` ran, each with its first command line (a Redis server comes back with its
        own data: the Sentinels turn a former primary into a replica)."""
        assert self.ha is not None
        for role in self.roles_on(name):
            if role.startswith("redis-"):
                self.ha.restart(role.split("-", 1)[1])
            elif role.startswith("sentinel-"):
                self.ha.restart(f"s{role.split('-', 1)[1]}")
            else:
                self._spawn(role)

    def roles_on(self, name: str) -> list[str]:
        return [role for role, host in self.layout.roles().items() if host == name]

    def primary_host(self) -> str | None:
        """The host of the server the Sentinels' majority names the primary now."""
        assert self.ha is not None
        primary = self.ha.primary()
        return self.layout.roles()[f"redis-{primary}"] if primary else None

    def logs(self) -> Iterator[tuple[str, str]]:
        """(role, its log's text) for every process the stack started."""
        for host in self.network.hosts.values():
            for process in host.processes:
                yield process.name, process.log_path.read_text(errors="replace")

    def describe(self) -> dict[str, Any]:
        return {
            "hosts": {name: host.address for name, host in self.network.hosts.items()},
            "roles": self.layout.roles(),
            "skew_s": {name: s for name, s in self.skew.items() if s},
            "python": sys.version.split()[0],
        }

    def stop(self) -> None:
        for host in self.network.hosts.values():
            for process in reversed(host.processes):
                if process.alive():
                    process.stop(timeout_s=10)
        if self.ha is not None:
            self.ha.stop()
