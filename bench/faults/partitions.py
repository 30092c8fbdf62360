"""`bench chaos --hosts`: the service as several hosts (bench.stack.cluster), a steady load, and a fault: a partition, a
host killed, a clock moved. Every client operation is recorded and the history checked afterwards
(bench.faults.history): what a 202 promised, and whether it was kept.

    python -m bench chaos --hosts --scenario primary-cut-api-near --runs 3
    python -m bench chaos --hosts --scenario all

Each scenario is a layout (which role runs on which host), a fault made at `fault_at_s` and undone after
`fault_s`, and a clock per host. The load: `qps` uploads a second, every image new, each job long-polled by its
client until it ends, and read once more after the run. A run passes when the checker finds nothing lost,
gone back, ended twice, expired early or billed off the clock, and no live worker was taken for dead.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.faults import harness
from bench.faults.harness import RunOptions
from bench.stack.cluster import HostedStack, Layout
from bench.stack.hosts import Network
from bench.stack.local import StackOptions

Fault = Callable[[HostedStack], None]

# A replica beside the primary, on its host: the layout that lost 249 of 375 jobs (issue 51).
WITH_NEAR_REPLICA = Layout(redis=("redis-a", "redis-a", "redis-c"))
CLOCK_DEADLINE_MS = 6000
# Log lines that say a live worker was taken for dead (a clock scenario must show none).
TAKEN_FOR_DEAD = ("was found dead", "presumed dead")


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    layout: Layout = field(default_factory=Layout)
    fault: Fault | None = None
    heal: Fault | None = None
    skew: dict[str, float] = field(default_factory=dict)  # host name: seconds
    # What the run must not show: a worker taken for dead (the clock scenarios: nothing was wrong with them).
    workers_stay_alive: bool = False
    # Every job's deadline_ms, if the scenario sets its own (the clock scenarios: issue 51's 6 s, which a host
    # 8 s ahead expired every time).
    deadline_ms: int | None = None


def _partition(near: Callable[[HostedStack], list[str]]) -> tuple[Fault, Fault]:
    """A fault that cuts the hosts `near(stack)` names from every other host (the client reaches both sides)."""

    def cut(stack: HostedStack) -> None:
        names = near(stack)
        side = [stack.host(n) for n in names]
        stack.network.partition(side, [h for n, h in stack.network.hosts.items() if n not in names])

    def heal(stack: HostedStack) -> None:
        stack.network.heal()

    return cut, heal


def _isolate(host_name: str) -> tuple[Fault, Fault]:
    def cut(stack: HostedStack) -> None:
        stack.network.isolate(stack.host(host_name))

    def heal(stack: HostedStack) -> None:
        stack.network.heal()

    return cut, heal


def _kill(host_name: str) -> tuple[Fault, Fault]:
    def kill(stack: HostedStack) -> None:
        stack.kill_host(host_name)

    def back(stack: HostedStack) -> None:
        stack.restart_host(host_name)

    return kill, back


def _primary_side(with_api: bool) -> Callable[[HostedStack], list[str]]:
    def near(stack: HostedStack) -> list[str]:
        primary = stack.primary_host() or stack.layout.redis[0]
        return [primary, stack.layout.api] if with_api else [primary]

    return near


def scenarios() -> dict[str, Scenario]:
    found = [
        Scenario("steady", "no fault: what each link carries (bytes per image), and the checker's baseline"),
        Scenario(
            "primary-cut-api-near",
            "the primary's host and the API's cut off from the rest (the Sentinels' majority, the other replicas, "
            "the workers); a replica on the primary's host",
            WITH_NEAR_REPLICA,
            *_partition(_primary_side(with_api=True)),
        ),
        Scenario(
            "primary-cut-api-far",
            "the primary's host (with a replica on it) cut off from every other host; the API on the far side",
            WITH_NEAR_REPLICA,
            *_partition(_primary_side(with_api=False)),
        ),
        Scenario(
            "primary-alone-cut-api-near",
            "the primary's host and the API's cut off from the rest; no replica on the primary's side",
            Layout(),
            *_partition(_primary_side(with_api=True)),
        ),
        Scenario(
            "primary-alone-cut-api-far",
            "the primary's host alone cut off from every other host",
            Layout(),
            *_partition(_primary_side(with_api=False)),
        ),
        Scenario(
            "primary-host-killed",
            "the primary's host, with a replica on it, killed whole (every process SIGKILLed at once); its processes "
            "started again when the fault ends",
            WITH_NEAR_REPLICA,
            *_kill("redis-a"),
        ),
        Scenario("cpu-host-cut", "one CPU worker's host cut off mid-task", Layout(), *_isolate("cpu-1")),
        Scenario("gpu-host-cut", "the GPU worker's host cut off mid-batch", Layout(), *_isolate("gpu")),
    ]
    # (Not a Redis server's host: its clock is the service's, so moving it moves every process's alike; and
    # libfaketime, the one way to move a C program's wall clock here, crashes redis-server 7.0 at start.)
    clocks = (("api", "the API"), ("cpu-1", "a CPU worker"), ("gpu", "the GPU worker"))
    for host, role in clocks:
        for skew in (10.0, -10.0):
            found.append(
                Scenario(
                    f"clock-{host}{skew:+.0f}s",
                    f"{role}'s host's clock {skew:+.0f} s against the others",
                    Layout(),
                    skew={host: skew},
                    workers_stay_alive=True,
                    deadline_ms=CLOCK_DEADLINE_MS,
                )
            )
    return {s.name: s for s in found}


def run_scenario(
    scenario: Scenario, options: StackOptions, images: list[bytes], run: RunOptions, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """One run of `scenario` on a fresh network and stack, through the one harness (bench.faults.harness): the checker's
    verdict, with the bytes per link, the workers taken for dead and where the primary ended."""
    return harness.run_scenario(hosted(scenario, options, run), images, _with_deadline(scenario, run), log)


def hosted(scenario: Scenario, options: StackOptions, run: RunOptions) -> harness.FaultScenario:
    """`scenario` as the harness runs it: its network and stack started together, its fault made and healed after
    `run.fault_s`."""

    def start() -> _Hosted:
        network = Network.create()
        workdir = Path(tempfile.mkdtemp(prefix=f"hosts-{scenario.name}-"))
        try:
            return _Hosted(HostedStack(workdir, network, options, scenario.layout, dict(scenario.skew)).start())
        except BaseException:
            network.close()
            raise

    def fault(hosts: _Hosted, log: Callable[[str], None]) -> tuple[float, float] | None:
        if scenario.fault is None:
            time.sleep(run.fault_s)
            return None
        scenario.fault(hosts.stack)
        began = time.monotonic()
        log(f"{scenario.name}: fault ({scenario.description})")
        time.sleep(run.fault_s)
        assert scenario.heal is not None
        scenario.heal(hosts.stack)
        log(f"{scenario.name}: healed after {time.monotonic() - began:.1f} s")
        return began, time.monotonic()

    def report(hosts: _Hosted) -> dict[str, Any]:
        links = hosts.stack.network.bytes_between().items()
        return {
            "taken_for_dead": _taken_for_dead(hosts.stack),
            "bytes": {f"{a}->{b}": n for (a, b), n in sorted(links) if n},
            "primary_at_end": hosts.stack.primary_host(),
            "reported": ("taken_for_dead", "primary_at_end"),
        }

    return harness.FaultScenario(
        scenario.name,
        scenario.description,
        start=start,
        fault=fault,
        report=report,
        ok=lambda verdict: not (scenario.workers_stay_alive and verdict["taken_for_dead"]),
    )


def _with_deadline(scenario: Scenario, run: RunOptions) -> RunOptions:
    return replace(run, deadline_ms=scenario.deadline_ms) if scenario.deadline_ms is not None else run


class _Hosted:
    """A hosted stack and its network, stopped together."""

    def __init__(self, stack: HostedStack) -> None:
        self.stack, self.url = stack, stack.url

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            self.stack.network.close()


def _taken_for_dead(stack: HostedStack) -> int:
    return sum(text.count(marker) for _, text in stack.logs() for marker in TAKEN_FOR_DEAD)


def table(verdicts: list[dict[str, Any]]) -> str:
    """The verdicts as a Markdown table, a row a run."""
    rows = [
        "| scenario | accepted / submitted | lost | went back | ended twice | expired early | bills off the clock | "
        "taken for dead | refused during the fault | first 202 after it | ends |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        during = sum(v["refused"].get("during", {}).values())
        first = v["first_202_after_heal_s"]
        rows.append(
            f"| {v['scenario']} | {v['accepted']} / {v['submitted']} | {v['lost']} | {v['went_back']} | "
            f"{v['ended_twice']} | {v['expired_early']} | {v['bills_off_clock']} | {v['taken_for_dead']} | {during} | "
            f"{'-' if first is None else f'{first:.1f} s'} | "
            + ", ".join(f"{k} {n}" for k, n in sorted(v["ends"].items()))
            + " |"
        )
    return "\n".join(rows)


def hosted_options(options: StackOptions) -> StackOptions:
    """The stack's options for hosts: one CPU child a host (two hosts), one API worker: this machine's two cores
    run ten hosts' processes."""
    return replace(options, cpu_workers=1, api_workers=1)
