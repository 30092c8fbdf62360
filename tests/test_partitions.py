"""The service as several hosts (bench.stack.hosts, bench.stack.cluster): network namespaces, cuts, a host killed, a
clock moved, and the history checker's verdict (bench.faults.history) on what a 202 promised. Needs root and iptables
(CI has both: scripts/bootstrap --dev installs iptables); skipped where this machine cannot make hosts.

CI runs one partition and one clock scenario, shortened; `make test-chaos` runs every scenario at full length
(`-m chaos`), as `python -m bench chaos --hosts --scenario all` does with figures."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.faults.harness import RunOptions, format_verdict
from bench.faults.partitions import hosted_options, run_scenario, scenarios
from bench.stack.hosts import OWNERS, HostsUnavailable, Network, check_can_make_hosts
from bench.stack.local import StackOptions
from tests.support import jpeg, wait_until

try:
    check_can_make_hosts()
    CANNOT = ""
except HostsUnavailable as exc:
    CANNOT = str(exc)

pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(CANNOT), reason=CANNOT or "hosts can be made")]

ECHO = (
    "import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 7000))\ns.listen()\n"
    "while True:\n    c, _ = s.accept()\n    c.sendall(b'hi')\n    c.close()"
)


def reaches(network: Network, client: str, server: str, timeout_s: float = 1.0) -> bool:
    """Whether `client` (a host's name, or "machine" for this namespace) gets the echo of `server`'s listener."""
    host = network.hosts[server]
    probe = (
        f"import socket; s = socket.create_connection(('{host.address}', 7000), timeout={timeout_s}); print(s.recv(2))"
    )
    prefix = [] if client == "machine" else list(network.hosts[client].prefix)
    done = subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    return "b'hi'" in done.stdout


def namespaces_here() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line}


def listen(network: Network, name: str, tmp_path) -> None:
    host = network.hosts[name]
    host.spawn(f"echo-{name}-{time.monotonic_ns()}", [sys.executable, "-c", ECHO], {}, tmp_path)
    wait_until(lambda: "7000" in host.run("ss", "-ltn").stdout, 10, what=f"{name}'s listener")


def test_hosts_are_cut_healed_cut_one_way_killed_and_removed(tmp_path):
    with Network.create() as network:
        a, b = network.add_host("a"), network.add_host("b")
        namespaces = {a.namespace, b.namespace}
        listen(network, "b", tmp_path)
        assert reaches(network, "a", "b")
        network.partition([a], [b])
        assert not reaches(network, "a", "b")
        assert reaches(network, "machine", "b")  # a host in neither side reaches both
        network.heal()
        assert reaches(network, "a", "b")
        network.cut_one_way(a, b)
        assert not reaches(network, "a", "b")
        network.heal()
        network.isolate(b)
        assert not reaches(network, "machine", "b")
        network.heal()
        assert b.pids()
        assert b.kill() >= 1 and b.pids() == []
        listed = {
            line.split()[0]
            for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        }
        assert namespaces <= listed
    listed = {
        line.split()[0]
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        if line
    }
    assert not namespaces & listed
    assert network.bridge not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_a_hosts_sending_rate_is_capped_and_uncapped():
    with Network.create() as network:
        host = network.add_host("slow")
        host.cap_rate("8mbit")
        assert "tbf" in host.run("tc", "qdisc", "show", "dev", "eth0").stdout
        assert "rate 8Mbit" in host.run("tc", "qdisc", "show", "dev", "eth0").stdout
        host.uncap()
        assert "tbf" not in host.run("tc", "qdisc", "show", "dev", "eth0").stdout


def test_what_a_dead_run_left_is_swept_and_a_live_runs_hosts_are_not(tmp_path):
    live = Network.create()
    dead = Network.create()
    try:
        live.add_host("x")
        left = dead.add_host("y")
        listen(dead, "y", tmp_path)
        (OWNERS / dead.tag).write_text("999999999")  # its owner died without closing it
        assert Network.sweep() >= 1
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert left.namespace not in listed and live.hosts["x"].namespace in listed
        assert left.pids() == []
    finally:
        dead.hosts.clear()
        live.close()
        dead.close()


def test_bytes_are_counted_per_link(tmp_path):
    with Network.create() as network:
        network.add_host("a")
        network.add_host("b")
        network.count_links()
        listen(network, "b", tmp_path)
        assert reaches(network, "a", "b")
        links = network.bytes_between()
        assert links[("a", "b")] > 0 and links[("b", "a")] > 0
        assert links.get(("a", "client"), 0) == 0


IMAGES = [jpeg(640, 480, seed=i) for i in range(6)]
OPTIONS = hosted_options(StackOptions(device="sim", sim_profile_ms={1: 5.0, 8: 20.0}))


def test_the_primarys_side_cut_off_with_a_replica_and_the_api_loses_no_accepted_job():
    """Issue 51's partition, shortened: the primary's host (a replica on it) and the API's cut off from the
    Sentinels' majority, the other replica and the workers. Before: every 202 of the partition was lost."""
    run = RunOptions(qps=8.0, fault_at_s=4.0, fault_s=8.0, after_s=14.0, deadline_ms=60_000, drain_s=60.0)
    verdict = run_scenario(scenarios()["primary-cut-api-near"], OPTIONS, IMAGES, run)
    print(format_verdict(verdict))
    assert verdict["ok"], format_verdict(verdict)
    assert verdict["lost"] == 0 and verdict["accepted"] >= 30
    assert sum(verdict["refused"].get("during", {}).values()) > 0  # the cut was real: it refused meanwhile
    assert verdict["primary_at_end"] == "redis-c"  # the Sentinels promoted the far replica
    assert set(verdict["ends"]) == {"succeeded"}


def test_a_gpu_host_ten_seconds_ahead_expires_nothing_early_and_bills_no_clock_error():
    """Issue 51's clock, shortened: the GPU worker's host 10 s ahead, jobs with a 6 s deadline. Before: 40 of
    40 expired before inference."""
    run = RunOptions(qps=6.0, fault_at_s=0.0, fault_s=0.0, after_s=12.0, drain_s=30.0)  # its deadline_ms: 6 s
    verdict = run_scenario(scenarios()["clock-gpu+10s"], OPTIONS, IMAGES, run)
    print(format_verdict(verdict))
    assert verdict["ok"], format_verdict(verdict)
    assert verdict["ends"] == {"succeeded": verdict["accepted"]} and verdict["accepted"] >= 50
    assert verdict["taken_for_dead"] == 0


@pytest.mark.chaos
@pytest.mark.parametrize("name", sorted(scenarios()))
def test_every_scenario_keeps_every_202(name):
    """make test-chaos: each scenario at the issue's length (a 20 s fault, 10 uploads a second)."""
    run = RunOptions(qps=10.0, fault_at_s=6.0, fault_s=20.0, after_s=15.0, deadline_ms=60_000, drain_s=90.0)
    verdict = run_scenario(scenarios()[name], OPTIONS, IMAGES, run)
    print(format_verdict(verdict))
    assert verdict["ok"], format_verdict(verdict)
