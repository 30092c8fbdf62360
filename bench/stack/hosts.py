"""Several hosts on one machine: a network namespace per host, joined by veth pairs to one bridge, and the
faults a network has: a host cut off, a partition between groups of hosts, one link cut one way, a host killed
whole, a link's rate capped, a host's clock moved.

    with Network.create() as net:
        api = net.add_host("api")
        api.spawn("api", argv, env, log_dir)      # `ip netns exec <its namespace> argv`
        net.partition([api], [other])             # both ways; net.heal() undoes every cut
        api.kill()                                # every process in it, SIGKILL, at once

What works on this kind of machine (root, 2 cores, a kernel without netem), measured: network namespaces, veth
pairs and bridges (a process runs on a "host" with `ip netns exec NAME cmd`, and inherits the environment);
iptables DROP rules on one side of a veth (a cut; rules per link give one-way cuts; traffic to an address on a
cut veth from its own host still passes, through `lo`); `tc qdisc ... tbf` rate caps, but not `netem` ("Specified
qdisc kind is unknown": no added latency or loss). A redis-server reached through a veth address refuses every
client in protected mode unless it has a password or `protected-mode no` (replicas and Sentinels on other hosts
log "Error reply to PING from master"); Sentinels need it too. libfaketime made the GPU worker's timed waits go
wrong even at a zero offset (hence the sitecustomize clocks below). Celery's "Substantial drift from <node>"
warning is a quick sign that a cut was real. Needs root and iptables.

Every namespace, veth, bridge and rule this makes is removed by `close`
(the context manager's exit, also on failure), and `Network.sweep` removes what a run that was killed left.
The machine's own namespace joins the bridge as `.1`: the client (the bench's load) runs there. A cut is an
iptables DROP in the cut host's own namespace, in a chain of its own (IMGSERVE-CUT), so that a heal is one
flush; bytes per link are counted by rules of another (IMGSERVE-COUNT), one per peer.

A host's clock: `Host.skew_s` moves the wall clock (`time.time`) of the Python processes started on it after
it is set, through a `sitecustomize` on their path (bench/stack/skew/). Not a Redis server's: libfaketime, the one
way to move a C program's wall clock here, crashes redis-server 7.0 at start (a recursive clock_gettime).
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.stack.processes import REPO_ROOT, ManagedProcess

NAMESPACE_PREFIX = "imgs-"  # every namespace this makes: imgs-<tag>-<host>
CUT_CHAIN, COUNT_CHAIN = "IMGSERVE-CUT", "IMGSERVE-COUNT"
SKEW_PATH = Path(__file__).resolve().parent / "skew"


class HostsUnavailable(RuntimeError):
    """This machine cannot make hosts (not root, no iptables, no namespaces): what is missing."""


def check_can_make_hosts() -> None:
    """HostsUnavailable unless this process can make namespaces and cut links."""
    if os.geteuid() != 0:
        raise HostsUnavailable("making hosts needs root (network namespaces, iptables)")
    for tool in ("ip", "iptables"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise HostsUnavailable(f"{tool} is not installed (apt-get install iproute2 iptables)")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass
class Host:
    """One host: a namespace with one interface (eth0) on the network's bridge, and the processes started in it."""

    network: Network
    name: str
    namespace: str
    address: str
    veth: str  # the bridge's end of its link, in the machine's namespace
    skew_s: float = 0.0
    processes: list[ManagedProcess] = field(default_factory=list)

    @property
    def prefix(self) -> tuple[str, ...]:
        """What a command line runs under to run on this host."""
        return ("ip", "netns", "exec", self.namespace)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(*self.prefix, *argv, check=check)

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with this host's clock for a Python process (its sitecustomize moves time.time)."""
        if not self.skew_s:
            return env
        path = env.get("PYTHONPATH", "")
        return {**env, "IMGSERVE_SKEW_S": repr(self.skew_s), "PYTHONPATH": f"{SKEW_PATH}{os.pathsep}{path}"}

    def spawn(
        self, name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path, root: Path = REPO_ROOT
    ) -> ManagedProcess:
        """`argv` started on this host, from the checkout `root` (the bench runs an older one beside this)."""
        process = ManagedProcess(name, [*self.prefix, *argv], self.env(env), log_dir, root=root)
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        """Every process in this host's namespace (ours, and whatever they started)."""
        listed = _run("ip", "netns", "pids", self.namespace, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    def kill(self) -> int:
        """The host dies: every process in it SIGKILLed at once (how many)."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        for process in self.processes:
            if not process.alive():
                process.process.wait(5)
        return len(pids)

    # --- its links --------------------------------------------------------------------------------------------

    def drop(self, peer: str | None = None, inbound: bool = True, outbound: bool = True) -> None:
        """Drop what comes from / goes to `peer` (an address; None: everyone) on this host's interface."""
        if inbound:
            self.run("iptables", "-A", CUT_CHAIN, "-i", "eth0", *(["-s", peer] if peer else []), "-j", "DROP")
        if outbound:
            self.run("iptables", "-A", CUT_CHAIN, "-o", "eth0", *(["-d", peer] if peer else []), "-j", "DROP")

    def heal(self) -> None:
        self.run("iptables", "-F", CUT_CHAIN)

    def cap_rate(self, rate: str, burst: str = "64kb", latency: str = "200ms") -> None:
        """Cap what this host sends (tc tbf): e.g. rate "100mbit"."""
        self.run(
            "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst, "latency", latency
        )

    def uncap(self) -> None:
        self.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def sent_bytes(self) -> dict[str, int]:
        """Bytes this host sent to each peer address since it started (and, under the client's address, the
        bytes it received from the machine's own namespace: the client's requests)."""
        listing = self.run("iptables", "-L", COUNT_CHAIN, "-v", "-x", "-n").stdout
        counted: dict[str, int] = {}
        for line in listing.splitlines():
            fields = line.split()
            if len(fields) >= 8 and fields[0].isdigit():
                source, destination = fields[-2], fields[-1]
                key = destination if destination != "0.0.0.0/0" else f"from {source}"
                counted[key] = counted.get(key, 0) + int(fields[1])
        return counted


class Network:
    """A bridge in this machine's namespace and the hosts on it (see the module's note)."""

    def __init__(self, tag: str, subnet: ipaddress.IPv4Network) -> None:
        self.tag = tag
        self.subnet = subnet
        self.bridge = f"imb{tag}"
        self.gateway = str(subnet.network_address + 1)  # this machine's own address on it: the client's
        self.hosts: dict[str, Host] = {}

    @classmethod
    def create(cls) -> Network:
        check_can_make_hosts()
        cls.sweep()
        tag = secrets.token_hex(2)
        subnet = _free_subnet()
        network = cls(tag, subnet)
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / tag).write_text(str(os.getpid()))  # whose: a sweep removes what a dead owner left
        try:
            _run("ip", "link", "add", network.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{network.gateway}/{subnet.prefixlen}", "dev", network.bridge)
            _run("ip", "link", "set", network.bridge, "up")
            # Where Docker runs, bridged traffic passes this namespace's FORWARD chain (br_netfilter), whose
            # policy Docker sets to DROP: the hosts would not reach each other.
            _run("iptables", "-I", "FORWARD", *network._forward_rule())
        except BaseException:
            network.close()
            raise
        return network

    def _forward_rule(self) -> tuple[str, ...]:
        return ("-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT")

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 10
        namespace = f"{NAMESPACE_PREFIX}{self.tag}-{name}"
        veth, inside = f"imv{self.tag}{index}", f"imp{self.tag}{index}"
        address = str(self.subnet.network_address + index)
        host = Host(self, name, namespace, address, veth)
        self.hosts[name] = host
        _run("ip", "netns", "add", namespace)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", inside, "netns", namespace)
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        host.run("ip", "link", "set", inside, "name", "eth0")
        host.run("ip", "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        host.run("ip", "link", "set", "eth0", "up")
        host.run("ip", "link", "set", "lo", "up")
        for chain, hooks in ((CUT_CHAIN, ("INPUT", "OUTPUT")), (COUNT_CHAIN, ("INPUT", "OUTPUT"))):
            host.run("iptables", "-N", chain)
            for hook in hooks:
                host.run("iptables", "-I" if chain == CUT_CHAIN else "-A", hook, "-j", chain)
        host.run("iptables", "-A", COUNT_CHAIN, "-i", "eth0", "-s", self.gateway, "-j", "RETURN")
        return host

    def count_links(self) -> None:
        """One counting rule per peer on every host (call once every host is added)."""
        for host in self.hosts.values():
            for peer in (*(h.address for h in self.hosts.values() if h is not host), self.gateway):
                host.run("iptables", "-A", COUNT_CHAIN, "-o", "eth0", "-d", peer, "-j", "RETURN")

    # --- faults -----------------------------------------------------------------------------------------------

    def isolate(self, host: Host) -> None:
        """`host` cut off from every other host and from the client, both ways."""
        host.drop()

    def partition(self, side: Iterable[Host], other: Iterable[Host]) -> None:
        """Nothing passes between a host of `side` and one of `other` (both ways); anyone else (the client, a
        host in neither) reaches both."""
        others = list(other)
        for host in side:
            for peer in others:
                host.drop(peer.address)

    def cut_one_way(self, sender: Host, receiver: Host) -> None:
        """What `sender` sends to `receiver` is dropped; the other way passes (an asymmetric cut)."""
        sender.drop(receiver.address, inbound=False)

    def heal(self) -> None:
        for host in self.hosts.values():
            host.heal()

    def bytes_between(self) -> dict[tuple[str, str], int]:
        """Bytes sent on each link since the hosts were made: (from, to) by host name, the client as "client"."""
        by_address = {host.address: name for name, host in self.hosts.items()}
        by_address[self.gateway] = "client"
        links: dict[tuple[str, str], int] = {}
        for name, host in self.hosts.items():
            for peer, sent in host.sent_bytes().items():
                if peer.startswith("from "):
                    links[("client", name)] = sent
                elif peer in by_address:
                    links[(name, by_address[peer])] = sent
        return links

    # --- clean-up ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Every process on every host stopped, then every namespace, veth and the bridge removed."""
        for host in self.hosts.values():
            for process in host.processes:
                if process.alive():
                    process.signal(signal.SIGKILL)
            host.kill()
        for host in self.hosts.values():
            _run("ip", "netns", "del", host.namespace, check=False)
            _run("ip", "link", "del", host.veth, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        _run("iptables", "-D", "FORWARD", *self._forward_rule(), check=False)
        self.hosts.clear()
        (OWNERS / self.tag).unlink(missing_ok=True)

    @staticmethod
    def sweep() -> int:
        """Remove what runs whose process has died left (their hosts' processes, namespaces, veths, bridge):
        how many namespaces. A run still going (another test process's) is left alone."""
        removed = 0
        for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
            name = line.split(" ")[0]
            if name.startswith(NAMESPACE_PREFIX) and not _owner_alive(name[len(NAMESPACE_PREFIX) :].split("-")[0]):
                for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _run("ip", "netns", "del", name, check=False)
                removed += 1
        links = _run("ip", "-o", "link", "show", check=False).stdout
        for match in re.finditer(r"^\d+: (im[bv]([0-9a-f]{4})\d*)[@:]", links, re.M):
            if not _owner_alive(match.group(2)):
                _run("ip", "link", "del", match.group(1), check=False)
                (OWNERS / match.group(2)).unlink(missing_ok=True)
        for rule in re.findall(
            r"^-A FORWARD (-i (imb[0-9a-f]{4}) .*)$", _run("iptables", "-S", "FORWARD").stdout, re.M
        ):
            if not _owner_alive(rule[1][3:]):
                _run("iptables", "-D", "FORWARD", *rule[0].split(), check=False)
        return removed


OWNERS = Path("/run/imgserve-hosts")  # a file per network: its tag, holding the pid of the process that made it


def _owner_alive(tag: str) -> bool:
    try:
        pid = int((OWNERS / tag).read_text())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no interface here uses."""
    used = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    taken = {ipaddress.ip_interface(m).network for m in re.findall(r"inet (\S+)", used)}
    for third in (secrets.randbelow(250) + 1 for _ in range(64)):
        subnet = ipaddress.IPv4Network(f"10.213.{third}.0/24")
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise HostsUnavailable("no free /24 in 10.213.0.0/16")


@contextmanager
def network() -> Iterator[Network]:
    net = Network.create()
    try:
        yield net
    finally:
        net.close()
