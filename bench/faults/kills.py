"""The `kills` scenario of the fault harness (bench.faults.harness): the whole stack on one machine under steady load,
while the GPU worker is SIGKILLed twice, a Celery child once, and Redis stopped once (3 s), spread over the fault's
window; each comes back. Redis keeps an append-only file fsynced on every write, as a deployment that must lose
nothing would. The verdict is the history checker's: nothing lost, gone back or ended twice.

    python -m bench chaos --device sim --qps 8 --duration 60
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.faults.harness import FaultScenario, Log
from bench.stack.local import LocalStack, StackOptions
from bench.stack.processes import children_of


def kills(options: StackOptions, duration_s: float) -> FaultScenario:
    """The scenario: its faults spread over `duration_s`."""
    options = replace(options, persistent_redis=True)
    return FaultScenario(
        "kills",
        "make run's stack under load: the GPU worker killed twice, a Celery child once, Redis stopped once",
        start=lambda: LocalStack(Path(tempfile.mkdtemp(prefix="chaos-")), options).start(),
        fault=lambda stack, log: _misbehave(stack, duration_s, log),
    )


def _misbehave(stack: LocalStack, duration_s: float, log: Log) -> tuple[float, float]:
    """Kill the GPU worker twice, a Celery child once, and stop Redis once, spread over `duration_s`."""
    started = time.monotonic()

    def at(fraction: float) -> None:
        time.sleep(max(0.0, started + duration_s * fraction - time.monotonic()))

    _kill_and_restart(stack, "gpu-worker", log)
    at(0.25)
    children = sorted(children_of(stack.process("cpu-worker").process.pid))
    if children:
        os.kill(children[0], signal.SIGKILL)
        log(f"SIGKILL celery child {children[0]}")
    at(0.5)
    _kill_and_restart(stack, "gpu-worker", log)
    at(0.7)
    log("stopping redis for 3 s")
    assert stack.redis is not None
    stack.redis.stop()
    time.sleep(3.0)
    stack.redis.start()
    log("redis is back")
    at(1.0)
    return started, time.monotonic()


def _kill_and_restart(stack: LocalStack, name: str, log: Log) -> None:
    stack.process(name).stop(signal.SIGKILL)
    log(f"SIGKILL {name}")
    time.sleep(1.0)
    stack.restart(name)
    log(f"restarted {name}")
