"""bench plane: its arithmetic (a phase's cost from two readings, net of the idle rate) and a short real run of the
product's processes through it, which must end every job and price each step in commands."""

from __future__ import annotations

import pytest

from bench.plane import PHASES, report, run_phases
from bench.plane_meter import PhaseCost, PhaseMeter, RedisReading
from bench.processes import REPO_ROOT


def test_a_phase_costs_what_redis_counted_between_two_readings_less_the_idle_rate():
    before = RedisReading(cpu_s=1.0, calls={"hget": 10, "evalsha": 2}, usec={"hget": 20, "evalsha": 100})
    after = RedisReading(
        cpu_s=1.5, calls={"hget": 110, "evalsha": 52, "lpush": 50}, usec={"hget": 220, "evalsha": 600, "lpush": 50}
    )
    cost = PhaseCost.between(before, after, images=50)
    assert cost.us == pytest.approx(10_000.0) and cost.commands == pytest.approx(4.0)
    assert cost.by_command == {"hget": (2.0, 4.0), "evalsha": (1.0, 10.0), "lpush": (1.0, 1.0)}
    meter = PhaseMeter(client=None, shards=[], images=50, counter=None)  # type: ignore[arg-type]
    meter.costs["intake"], meter.seconds["intake"] = cost, 2.0
    idle = PhaseCost(us=1000.0, commands=5.0, instructions=None)  # a second's worth
    net = meter.net(idle)["intake"]
    assert net.us == pytest.approx(10_000.0 - 1000.0 * 2.0 / 50) and net.commands == pytest.approx(4.0 - 0.2)


@pytest.mark.integration
def test_a_short_run_ends_every_job_and_prices_each_step(tmp_path):
    side = run_phases(REPO_ROOT, images=24, shards=1, clients=4, workdir=tmp_path)
    assert side["ended"] == {"succeeded": 24}
    for phase in PHASES:
        assert side["phases"][phase].commands > 0, phase
    assert side["phases"]["cpu"].by_command.get("evalsha", (0, 0))[0] >= 1  # the claim and the push, an image each
    text = report({"this checkout": side})
    assert "images/s per control-plane core" in text and "| intake |" in text
