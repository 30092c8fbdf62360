"""The one fault harness (issue 62): steady load with every client operation recorded, a fault, every accepted job
followed to its end, and the history checker's verdict (bench.faults.history). Each scenario says only how its stack
starts and what goes wrong; the load, the following and the verdict are this module's, for all of them:

- on one machine (`LOCAL_SCENARIOS` here): `kills` (the GPU worker, a Celery child and Redis killed and brought back),
  `failover` (the Sentinel-managed primary SIGKILLed, back later as a replica), `upgrade` (each role replaced by this
  checkout's: bench.faults.upgrade); and two cells behind one API: `cell-kill` (bench.faults.cell_kill), `cell-failover`
  and `cell-gpu-kill` (bench.faults.cell_faults), `cell-cut` (bench.faults.cell_cut: three hosts);
- on several hosts (network namespaces: bench.faults.partitions' scenarios): partitions, dead hosts, skewed clocks.

`python -m bench chaos --scenario list` names them all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import requests

from bench.faults.history import History, check, kept
from bench.load.client import ImageStream, session_for
from contract.jobs.record import TERMINAL

Log = Callable[[str], None]


@dataclass
class RunOptions:
    qps: float = 10.0
    fault_at_s: float = 6.0
    fault_s: float = 20.0
    after_s: float = 10.0  # load after the fault's end
    deadline_ms: int = 60_000
    drain_s: float = 90.0  # the longest a job is followed after the load stops


class Served(Protocol):
    """A stack a scenario started: where it answers, and how it stops."""

    url: str

    def stop(self) -> None: ...


@dataclass(frozen=True)
class FaultScenario:
    """A scenario: `start` makes its stack (on one machine, or on several hosts: bench.faults.partitions); `fault` does
    what goes wrong (the load runs meanwhile) and returns its window (monotonic seconds: refusals are counted
    before, during and after it); `report` adds what only this scenario can say (how the stack recovered) to the
    verdict, before the stack stops."""

    name: str
    description: str
    start: Callable[[], Served]
    fault: Callable[[Any, Log], tuple[float, float] | None]  # None: no fault (a baseline run)
    report: Callable[[Any], dict[str, Any]] = lambda stack: {}
    ok: Callable[[dict[str, Any]], bool] = lambda verdict: True  # more than the checker's promises


def run_scenario(scenario: FaultScenario, images: list[bytes], options: RunOptions, log: Log = print) -> dict[str, Any]:
    """One run of `scenario`: the checker's verdict, with the scenario's own figures; `ok` when every promise held
    (nothing lost, gone back, ended twice, expired early, billed off the clock) and the scenario's own check."""
    stack = scenario.start()
    try:
        history = History()
        load = Load(stack.url, images, options, history)
        started = time.monotonic()
        load.start()
        time.sleep(options.fault_at_s)
        history.fault = scenario.fault(stack, log)
        _at((history.fault[1] if history.fault else time.monotonic()) + options.after_s)
        load.stop()
        log(
            f"{scenario.name}: load stopped after {time.monotonic() - started:.0f} s; following "
            f"{len(history.accepted())} accepted jobs to their end"
        )
        load.drain(options.drain_s)
        verdict = check(history, options.deadline_ms)
        verdict.update(scenario.report(stack))
    finally:
        stack.stop()
    verdict["scenario"] = scenario.name
    verdict["ok"] = kept(verdict) and scenario.ok(verdict)
    return verdict


def _at(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


class Load:
    """Submissions at a steady rate (each on a thread of a pool: a slow answer does not slow the next), each
    accepted job long-polled until it ends; `drain` follows what is left, then reads every accepted job once
    more. Every operation goes into the history."""

    def __init__(self, url: str, images: list[bytes], run: RunOptions, history: History) -> None:
        self.url, self.run, self.history = url, run, history
        self.stream = ImageStream(images)  # every image new: computed, not answered from the result cache
        self.submitters = ThreadPoolExecutor(32)
        self.followers = ThreadPoolExecutor(96)
        self.session = session_for(128)
        self.stopping = threading.Event()
        self.pacer = threading.Thread(target=self._pace, name="load", daemon=True)

    def start(self) -> None:
        self.pacer.start()

    def stop(self) -> None:
        self.stopping.set()
        self.pacer.join()
        self.submitters.shutdown(wait=True)

    def drain(self, limit_s: float) -> None:
        self.give_up_at = time.monotonic() + limit_s
        self.followers.shutdown(wait=True)
        with ThreadPoolExecutor(16) as final:
            list(final.map(self._read_final, list(self.history.accepted())))

    def _pace(self) -> None:
        interval, i, next_at = 1.0 / self.run.qps, 0, time.monotonic()
        self.give_up_at = float("inf")
        while not self.stopping.is_set():
            self.submitters.submit(self._submit, self.stream.next(i))
            i += 1
            next_at += interval
            self.stopping.wait(max(0.0, next_at - time.monotonic()))

    def _submit(self, image: bytes) -> None:
        started = time.monotonic()
        try:
            response = self.session.post(
                f"{self.url}/v1/jobs",
                data=image,
                params={"deadline_ms": self.run.deadline_ms},
                headers={"Content-Type": "image/jpeg"},
                timeout=15,
            )
        except requests.RequestException as exc:
            self.history.submit(started, type(exc).__name__)
            return
        if response.status_code == 202:
            job = response.json()["id"]
            self.history.submit(started, 202, job)
            self.followers.submit(self._follow, job, started)
        else:
            self.history.submit(started, response.status_code, problem=problem_of(response))

    def _follow(self, job: str, submitted: float) -> None:
        until = submitted + self.run.deadline_ms / 1000.0 + 30.0
        while time.monotonic() < min(until, self.give_up_at):
            _, doc = self._read(job, wait_s=5)
            if doc is not None and doc.get("status") in TERMINAL:
                return
            if doc is None:
                time.sleep(0.2)

    def _read_final(self, job: str) -> None:
        """The read after the run: asked again while the service says 503 (it may not show an end yet)."""
        until = time.monotonic() + 30.0
        while time.monotonic() < until:
            code, _ = self._read(job, wait_s=0)
            if code in (200, 404, 410):
                return
            time.sleep(0.3)

    def _read(self, job: str, wait_s: float) -> tuple[int | str, dict[str, Any] | None]:
        """One read, recorded: (its HTTP status or exception, the job document when it was 200)."""
        started = time.monotonic()
        try:
            response = self.session.get(
                f"{self.url}/v1/jobs/{job}", params={"wait": wait_s} if wait_s else None, timeout=wait_s + 15
            )
        except requests.RequestException as exc:
            self.history.read(job, started, type(exc).__name__, None)
            return type(exc).__name__, None
        if response.status_code != 200:
            self.history.read(job, started, response.status_code, None, problem_of(response))
            return response.status_code, None
        doc = response.json()
        self.history.read(job, started, 200, doc)
        return 200, doc


def problem_of(response: requests.Response) -> str:
    """A refusal's problem type, its last part ('' when the answer is not a problem document)."""
    if not response.headers.get("Content-Type", "").endswith("json"):
        return ""
    try:
        return str(response.json().get("type", "")).rsplit("/", 1)[-1]
    except ValueError:
        return ""


def format_verdict(verdict: dict[str, Any]) -> str:
    """One run's verdict on a line."""
    refused = "; ".join(
        f"{phase}: " + ", ".join(f"{k} x{v}" for k, v in counts.items()) for phase, counts in verdict["refused"].items()
    )
    extra = {k: verdict[k] for k in verdict.get("reported", ())}
    return (
        f"{verdict['scenario']}: {'OK' if verdict['ok'] else 'BROKEN'} | accepted {verdict['accepted']} of "
        f"{verdict['submitted']}, ends {verdict['ends']}, lost {verdict['lost']}, went back {verdict['went_back']}, "
        f"ended twice {verdict['ended_twice']}, expired early {verdict['expired_early']}, bills off the clock "
        f"{verdict['bills_off_clock']}, live status went back {verdict['live_status_went_back']} | refused: "
        f"{refused or 'none'} | first 202 after the fault: {verdict['first_202_after_heal_s']} s"
        + (f" | {extra}" if extra else "")
        + (f" | examples {verdict['examples']}" if verdict["examples"] else "")
    )
