"""Retry-After in a burst on a stack that was idle: what a refusal says against how long its backlog took to drain.
The rate must be the workers' now, not one averaged over the quiet minutes before the burst."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis
import requests

from app.drain import MAX_RETRY_AFTER_S, Drain, DrainMeter, retry_after_s
from contract.jobs.backlog import queue_depths
from contract.redis.clock import now as service_now
from contract.redis.keys import Keys, model_frames_total
from contract.workers.heartbeat import Heartbeat, HeartbeatModel
from tests.conftest import Stack, content_box_spec, start_stack, stop_stack
from tests.support import REPO_ROOT, jpeg, wait_until

CLIENTS = 16
BURST_DEADLINE_S = 30  # a burst that was never refused by then fails the test that needs a refusal
PATIENCE_S = 10  # a client told to wait longer gives up (the test fails on it; main answered 60)


@pytest.fixture(scope="module")
def burst_stack(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A simulated device slow enough (about 10 jobs/s in batches of 8) that a burst lasts seconds."""
    workdir = tmp_path_factory.mktemp("burst")
    url = redis_server.url.rsplit("/", 1)[0] + "/13"
    stack = start_stack(
        url,
        workdir,
        content_box_spec(workdir, 64),
        "burst",
        {"backpressure": {"max_backlog": 8}, "gpu_worker": {"sim_latency_ms": {1: 200, 8: 800}}},
        gpu_device="sim",
    )
    yield stack
    stop_stack(stack)


def backlog(stack: Stack) -> int:
    model_key = stack.settings.model.key
    return sum(queue_depths(stack.redis, stack.keys, [model_key], stack.settings.tenants)[model_key].values())


@dataclass
class Burst:
    """CLIENTS clients at once, each submitting until `jobs_each` of its jobs are taken and the burst has been
    refused at least once (within BURST_DEADLINE_S: on a slow machine the first jobs may all fit), obeying each
    refusal's Retry-After (up to PATIENCE_S: longer, it gives up)."""

    stack: Stack
    jobs_each: int
    seed: int
    until: threading.Event | None = None  # set: the clients go on submitting until it is set
    refusals: list[tuple[float, int]] = field(default_factory=list)  # (when, Retry-After)
    accepted: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        return threads

    def client(self, index: int) -> None:
        session, taken, seed = requests.Session(), 0, self.seed + index * 1000
        deadline = time.monotonic() + BURST_DEADLINE_S
        while (
            taken < self.jobs_each
            or (not self.refusals and time.monotonic() < deadline)
            or (self.until is not None and not self.until.is_set())
        ):
            seed += 1
            response = session.post(
                self.stack.url("/v1/jobs"),
                data=jpeg(80, 60, seed=seed),
                timeout=30,
                headers={"Content-Type": "image/jpeg"},
            )
            if response.status_code == 202:
                with self.lock:
                    self.accepted.append(response.json()["id"])
                taken += 1
                continue
            assert response.status_code == 429, response.text
            retry_after = int(response.headers["Retry-After"])
            with self.lock:
                self.refusals.append((time.monotonic(), retry_after))
            if retry_after > PATIENCE_S:
                return
            time.sleep(retry_after)  # the client obeys Retry-After: this wait is its behaviour, not a synchronisation


def test_a_burst_after_idle_is_told_to_come_back_within_twice_the_measured_drain(burst_stack):
    stack = burst_stack
    # A few jobs first: the workers' long windows then hold a handful of jobs over minutes, a rate near zero.
    for seed in range(3):
        assert stack.wait_terminal(stack.submit_ok(jpeg(80, 60, seed=seed)))["status"] == "succeeded"
    burst = Burst(stack, jobs_each=3, seed=100)
    for thread in burst.start():
        thread.join(60)
    wait_until(lambda: backlog(stack) == 0, 60, interval_s=0.02, what="the backlog to drain")
    drained_at = time.monotonic()

    refusals = burst.refusals
    assert refusals, "the burst was never refused: nothing measured"
    least = stack.settings.backpressure.retry_after_s
    too_long = [
        (round(drained_at - at, 2), retry_after)
        for at, retry_after in refusals
        if retry_after > max(least, math.ceil(2 * (drained_at - at)))
    ]
    drains = [drained_at - at for at, _ in refusals]
    print(
        f"{len(burst.accepted)} accepted, {len(refusals)} refused, Retry-After {sorted({r for _, r in refusals})}, "
        f"the backlog drained {min(drains):.2f}-{max(drains):.2f} s after them"
    )
    assert not too_long, f"(drained after s, Retry-After) past twice the drain: {too_long}"
    assert all(retry_after >= least for _, retry_after in refusals)
    docs = [stack.wait_terminal(job_id) for job_id in burst.accepted]
    assert {doc["status"] for doc in docs} == {"succeeded"}


FOLDER_FILES = 40
FILES_BESIDE_THE_BURST = 6  # the CLI's files that go while the burst keeps the backlog full


def test_the_cli_submits_a_whole_folder_beside_a_burst(burst_stack, tmp_path):
    """Issue 69: `imgserve submit DIR` beside a burst sent 17 of 240 files, printed the 429 and stopped."""
    stack = burst_stack
    for n in range(FOLDER_FILES):
        (tmp_path / f"photo{n:02}.jpg").write_bytes(jpeg(80, 60, seed=5000 + n))
    through = threading.Event()
    burst = Burst(stack, jobs_each=2, seed=9000, until=through)
    threads = burst.start()
    cli = subprocess.Popen(
        # --retries 60: the default 20 is a person's patience; against sixteen clients obeying the same Retry-After
        # the first file lost 21 rounds in a row once on a loaded machine. What is tested is going on after
        # refusals (the 120 s bound on them in all still holds), not winning a draw.
        [
            sys.executable,
            "-m",
            "imgserve_client.cli",
            "--url",
            stack.api.url,
            "--retries",
            "60",
            "submit",
            str(tmp_path),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    accepted: list[str] = []

    def read_accepted() -> None:
        # The burst keeps the backlog full while the CLI's first files go (each refused, then sent again after its
        # Retry-After), and stops once they are through: sixteen clients that never stop would win the freed
        # slots sixteen times in seventeen, a race the CLI's patience loses on a slow machine, not a behaviour.
        assert cli.stdout is not None
        for line in cli.stdout:
            accepted.append(line)
            if len(accepted) >= FILES_BESIDE_THE_BURST:
                through.set()

    said: list[str] = []
    readers = [
        threading.Thread(target=read_accepted),
        threading.Thread(target=lambda: said.extend(cli.stderr or ())),  # drained, so the CLI never blocks on it
    ]
    for reader in readers:
        reader.start()
    try:
        cli.wait(timeout=180)
    finally:
        through.set()
        cli.kill()
        for reader in readers:
            reader.join(10)
        for thread in threads:
            thread.join(60)
    result = subprocess.CompletedProcess(cli.args, cli.returncode, "".join(accepted), "".join(said))
    assert result.returncode == 0, result.stderr
    lines = [line.split("\t") for line in result.stdout.splitlines()]
    assert [path for path, _ in lines] == [str(path) for path in sorted(tmp_path.glob("*.jpg"))]
    assert "sent again after their Retry-After" in result.stderr  # it was refused, and went on
    for _, job_id in lines:
        assert stack.session.get(stack.url(f"/v1/jobs/{job_id}"), timeout=10).status_code == 200


# --- the drain meter, on a private Redis with a clock the test moves -------------------------------------------
MODEL = "m:1"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(client: redis.Redis, keys: Keys, worker: str, model_key: str = MODEL) -> None:
    """A live GPU worker serving `model_key`, as its heartbeat says."""
    name, version = model_key.split(":")
    served = HeartbeatModel(name=name, version=version, device="sim")
    heartbeat = Heartbeat(worker_id=worker, pid=1, host="h", started_at=service_now(), model=served, models=[served])
    client.set(keys.heartbeat(worker), heartbeat.to_redis())
    client.zadd(keys.gpu_workers, {worker: service_now()})


def answered(client: redis.Redis, keys: Keys, worker: str, frames: int, model_key: str = MODEL) -> None:
    client.hset(keys.gpu_counters(worker), model_frames_total(model_key), frames)


def test_the_drain_rate_is_the_burst_s_not_the_idle_minutes_before_it(redis_client):
    keys, clock = Keys("drain"), Clock()
    meter = DrainMeter(redis_client, keys, heartbeat_ttl_s=10.0, clock=clock)
    beat(redis_client, keys, "a")
    answered(redis_client, keys, "a", 3)
    assert meter.drain(MODEL) == Drain(rate=None, span_s=0.0)  # one reading: no rate yet
    clock.now += 300  # five idle minutes, then a burst: 20 jobs a second
    answered(redis_client, keys, "a", 5)
    assert meter.drain(MODEL).rate is None  # the idle stretch is not measured over
    for second in range(1, 4):
        clock.now += 1
        answered(redis_client, keys, "a", 5 + 20 * second)
        assert meter.drain(MODEL).rate == pytest.approx(20.0)
    clock.now += 0.5  # within the second: the last answer, nothing read
    answered(redis_client, keys, "a", 1000)
    assert meter.drain(MODEL).rate == pytest.approx(20.0)


def test_a_restarted_worker_and_a_second_one_count_what_they_answered(redis_client):
    keys, clock = Keys("drain2"), Clock()
    meter = DrainMeter(redis_client, keys, heartbeat_ttl_s=10.0, clock=clock)
    beat(redis_client, keys, "a")
    beat(redis_client, keys, "b")
    answered(redis_client, keys, "a", 500)
    meter.drain(MODEL)
    clock.now += 2
    answered(redis_client, keys, "a", 10)  # restarted: counting from zero again
    answered(redis_client, keys, "b", 30)  # first batch since the last reading: its field was absent (0)
    assert meter.drain(MODEL).rate == pytest.approx(20.0)


def test_no_gpu_worker_serving_the_model_is_the_longest_answer(redis_client):
    keys = Keys("drain3")
    beat(redis_client, keys, "a", model_key="other:1")
    drain = DrainMeter(redis_client, keys, heartbeat_ttl_s=10.0, clock=Clock()).drain(MODEL)
    assert drain == Drain(unserved=True)
    assert retry_after_s(10, drain, least=1) == MAX_RETRY_AFTER_S


@pytest.mark.parametrize(
    ("jobs", "drain", "expected"),
    [
        (40, Drain(rate=20.0, span_s=3.0), 2),  # 2 s to drain 40 at 20/s
        (41, Drain(rate=20.0, span_s=3.0), 3),  # whole seconds, rounded up
        (1, Drain(rate=20.0, span_s=3.0), 1),  # never under the least
        (10_000, Drain(rate=1.0, span_s=10.0), MAX_RETRY_AFTER_S),  # never over the most
        # A burst's first seconds, on a CPU device answering a batch every 1.5-2 s: a rate read over a span that
        # saw one small batch told 11 waiting jobs 16 s (seen: 10-34 s; they drained in 2-5). At most twice the span.
        (11, Drain(rate=0.7, span_s=1.5), 3),
        (11, Drain(rate=0.5, span_s=4.0), 8),
        (10, Drain(rate=None), 1),  # no rate measured yet: short, the next refusal knows more
        (10, Drain(rate=0.0, span_s=4.2), 5),  # nothing answered for 4.2 s of refusals: at least that long
    ],
)
def test_retry_after_is_the_jobs_over_the_rate_now_bounded(jobs: float, drain: Drain, expected: int) -> None:
    assert retry_after_s(jobs, drain, least=1) == expected
