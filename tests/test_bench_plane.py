"""bench plane: its arithmetic (a phase's cost from two readings, net of the idle rate) and a short real run of the
product's processes through it, which must end every job and price each step in commands."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.meters.plane import APART, PHASES, report, run_phases
from bench.meters.plane_meter import PhaseCost, PhaseMeter, RedisReading, RoundTripCounter
from bench.meters.plane_report import round_medians, rounds_report, rounds_summary
from bench.stack.processes import REPO_ROOT, RedisServer

# A process's Redis traffic, step by step when the test says so on stdin: a connection opened (its set-up and a
# PING); a command, a pipeline of three, a MULTI block of two; then a forked child's own connection and command.
_TRAFFIC = """
import os, sys, redis
client = redis.Redis(port=int(sys.argv[1]))
client.ping()
print("connected", flush=True); sys.stdin.readline()
client.get("marker")
client.pipeline(transaction=False).set("a", 1).get("a").incr("n").execute()
client.pipeline(transaction=True).set("b", 1).get("b").execute()
print("sent", flush=True); sys.stdin.readline()
pid = os.fork()
if pid == 0:
    redis.Redis(port=int(sys.argv[1])).get("a")
    os._exit(0)
os.waitpid(pid, 0)
"""


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
def test_round_trips_are_counted_at_each_connection_a_pipeline_or_block_as_one(tmp_path):
    server = RedisServer(tmp_path)
    try:
        counter = RoundTripCounter(tmp_path / "trips")
        env = counter.env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "probe")
        probe = subprocess.Popen(
            [sys.executable, "-c", _TRAFFIC, str(server.port)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert probe.stdin and probe.stdout and probe.stdout.readline() == "connected\n"
        connected = counter.read(server.port)["probe"]
        probe.stdin.write("go\n")
        probe.stdin.flush()
        assert probe.stdout.readline() == "sent\n"
        sent = counter.read(server.port)["probe"]
        probe.stdin.write("go\n")
        probe.stdin.flush()
        assert probe.wait(60) == 0
        with_child = counter.read(server.port)["probe"]
        files = list((tmp_path / "trips").iterdir())
    finally:
        server.stop()
    # the GET, the pipeline, the block: one each; the child counts its connection's set-up and GET in a file of its own
    assert connected >= 2 and sent - connected == 3, (connected, sent)
    assert with_child - sent >= 2 and len(files) == 2


@pytest.mark.integration
def test_a_short_run_ends_every_job_and_prices_each_step(tmp_path):
    side = run_phases(REPO_ROOT, images=24, shards=1, clients=4, workdir=tmp_path, set_apart=8)
    assert side["ended"] == {"succeeded": 24}
    for phase in PHASES:
        assert side["phases"][phase].commands > 0, phase
        assert side["phases"][phase].trips > 0, phase
    assert side["phases"]["cpu"].by_command.get("fcall", (0, 0))[0] >= 1  # the claim and the push, an image each
    # the job's transaction ending in take_in (its upload on the shard, counted there): one round trip, a reader's one;
    # a short run's new connections (HELLO, PING) add up to ~0.6, and two round trips (the step before) read >= 1.9
    assert 0.9 <= side["phases"]["intake"].round_trips["api"] < 1.9, side["phases"]["intake"]
    assert 0.9 <= side["phases"]["read"].round_trips["api"] < 2.0, side["phases"]["read"]
    # the GPU worker's start-up SCAN is reported apart, not in the gpu step an image pays
    assert "scan" in side["apart"]["gpu-start"].by_command and "scan" not in side["phases"]["gpu"].by_command
    assert side["apart"]["gpu-start"].round_trips["gpu-worker"] >= 3
    assert set(side["apart"]) == set(APART) and side["apart"]["intake-listpack"].commands > 0
    # the first answers (the result cache's LRU index a listpack) apart too: their batch writes are priced there
    assert side["apart"]["gpu-listpack"].by_command.get("fcall", (0, 0))[0] > 0, side["apart"]["gpu-listpack"]
    assert side["phases"]["gpu"].by_command.get("fcall", (0, 0))[0] > 0, side["phases"]["gpu"]
    # the CPU worker's start apart too, its queues parked meanwhile: its connections, kombu's bindings (SADD) and the
    # library check (FUNCTION LIST) there, not in the cpu step; no job taken there (no claim, no push: no FCALL)
    start, cpu = side["apart"]["cpu-start"], side["phases"]["cpu"]
    assert start.round_trips["cpu-worker"] >= 10 and "hello" in start.by_command, start
    for command in ("sadd", "function|list"):
        assert command in start.by_command and command not in cpu.by_command, (command, start, cpu)
    assert "fcall" not in start.by_command and "client|list" not in start.by_command, start
    text = report({"this checkout": side})
    assert "images/s per control-plane core" in text and "| intake |" in text and "Round trips an image" in text
    assert "| the CPU worker's start (in all, once) |" in text


def _side(us: dict[str, float], instructions: float | None = None) -> dict[str, object]:
    phases = {phase: PhaseCost(us=us[phase], commands=10.0, instructions=instructions) for phase in PHASES}
    total = PhaseCost(us=sum(us.values()), commands=40.0, instructions=instructions and instructions * 4)
    return {"phases": phases, "total": total}


def test_rounds_report_each_round_and_the_medians_of_each_side_and_of_the_ratios():
    steps = dict.fromkeys(PHASES, 100.0)
    base_us, head_us = [400.0, 480.0, 440.0], [320.0, 400.0, 396.0]  # ratios 0.8, 0.833, 0.9
    rounds = [
        {
            "base abc": _side({**steps, "cpu": b - 300.0}),
            "this checkout": _side({**steps, "cpu": h - 300.0}),
        }
        for b, h in zip(base_us, head_us)
    ]
    medians = round_medians(rounds)
    assert set(medians) == {"us"}  # no instructions counted: no such table
    total = medians["us"]["total"]
    assert total["base abc"] == 440.0 and total["this checkout"] == 396.0
    # the median of the rounds' ratios, not the ratio of the medians (396 / 440 = 0.9 too here: see cpu below)
    assert total["ratios"] == pytest.approx([0.8, 400 / 480, 0.9]) and total["ratio"] == pytest.approx(400 / 480)
    cpu = medians["us"]["cpu"]
    assert cpu["base abc"] == 140.0 and cpu["this checkout"] == 96.0
    assert cpu["ratio"] == pytest.approx(100 / 180) and cpu["ratio"] != pytest.approx(96 / 140)
    assert medians["us"]["intake"]["ratio"] == pytest.approx(1.0)
    line = rounds_summary(rounds)
    assert line == (
        "main-thread µs an image, median of 3 rounds: base 440, this checkout 396, ratio 0.833 "
        "(rounds: 0.800, 0.833, 0.900)"
    )
    text = rounds_report(rounds)
    assert "| **all** | 400 / 320 (0.800x) | 480 / 400 (0.833x) | 440 / 396 (0.900x) | 440 | 396 | 0.833x |" in text
    assert "| cpu | 100 / 20 (0.200x)" in text and "instructions an image" not in text


def test_rounds_with_instructions_say_them_too():
    steps = dict.fromkeys(PHASES, 100.0)
    rounds = [{"base abc": _side(steps, 1000.0 * k), "this checkout": _side(steps, 700.0 * k)} for k in (1.0, 1.1, 0.9)]
    medians = round_medians(rounds)
    assert medians["instructions"]["total"]["ratio"] == pytest.approx(0.7)
    assert medians["instructions"]["total"]["base abc"] == pytest.approx(4000.0)
    lines = rounds_summary(rounds).splitlines()
    assert len(lines) == 2 and lines[1].startswith("instructions an image, median of 3 rounds: base 4,000, ")
    assert "instructions an image, round by round" in rounds_report(rounds)
