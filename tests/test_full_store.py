"""A Redis at its maxmemory must not take the service down: bytes are budgeted before they are stored,
refusals say what is full and for how long, and nothing accepted is lost."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis
import requests

from app.services import services as api_services
from bench.stack.processes import RedisServer
from contract.admission import budget
from tests.conftest import content_box_spec, start_stack, stop_stack
from tests.support import encode, make_image, wait_until

MAXMEMORY = 64 * 1024 * 1024
UPLOAD_LIMIT = 6 * 1024 * 1024
# Redis holds more than the bytes waiting: uploads still arriving sit in its query buffers, the ones being read
# in its reply buffers, and a connection that carried an upload keeps a buffer its size (JobIntake.create).
BUDGET = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def full_store_stack(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("full-store")
    server = RedisServer(workdir, extra_args=("--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction"))
    stack = start_stack(
        server.url,
        workdir,
        content_box_spec(workdir, 64),
        "fullstore",
        {
            "api": {"max_upload_bytes": UPLOAD_LIMIT},
            "backpressure": {"max_waiting_bytes": BUDGET, "max_total_waiting_bytes": BUDGET},
        },
    )
    yield stack, server
    stop_stack(stack)
    server.stop()


def big_jpeg(seed: int) -> bytes:
    """About 3 MB: noise compresses badly."""
    rng = np.random.default_rng(seed)
    from PIL import Image

    return encode(Image.fromarray(rng.integers(0, 255, (1400, 1800, 3), dtype=np.uint8)), "JPEG", quality=95)


def test_bursts_of_large_uploads_stay_within_the_budget_and_nothing_accepted_is_lost(full_store_stack):
    stack, server = full_store_stack
    client = redis.Redis.from_url(server.url)
    images = [big_jpeg(seed) for seed in range(4)]
    assert 2_500_000 < len(images[0]) < UPLOAD_LIMIT
    small = encode(make_image(120, 90), "JPEG")
    accepted: list[str] = []
    refusals: Counter[tuple[int, str]] = Counter()
    retry_afters: list[int] = []
    peak = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def submit(data: bytes) -> None:
        response = requests.post(stack.url("/v1/jobs"), data=data, headers={"Content-Type": "image/jpeg"}, timeout=60)
        with lock:
            if response.status_code == 202:
                accepted.append(response.json()["id"])
            else:
                refusals[(response.status_code, response.json()["type"])] += 1
                retry_afters.append(int(response.headers["Retry-After"]))

    def watch_memory() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], int(client.info("memory")["used_memory"]))

    def steady_small() -> None:
        while not stop.is_set():
            submit(small)
            stop.wait(0.2)  # five small images a second meanwhile

    def waiting_bytes() -> int:
        return budget.WaitingBytes(client, stack.keys).waiting().get(budget.ALL, 0)

    watchers = [threading.Thread(target=watch_memory), threading.Thread(target=steady_small)]
    for thread in watchers:
        thread.start()
    try:
        for _burst in range(2):  # two bursts of 40 concurrent large uploads
            with ThreadPoolExecutor(40) as pool:
                list(pool.map(submit, [images[i % len(images)] for i in range(40)]))
            # The next burst once the budget has room again for some of it (the work drained by half).
            wait_until(lambda: waiting_bytes() <= BUDGET // 2, 120, what="the first burst's bytes to drain")
    finally:
        stop.set()
        for thread in watchers:
            thread.join()
    # Every job accepted, the small ones sent up to the stop included (one accepted while the others were
    # awaited was left unawaited, its bytes still waiting at the last assertion: CI met it).
    docs = [stack.wait_terminal(job_id, timeout_s=120) for job_id in accepted]
    print(
        f"accepted {len(accepted)}, refused {dict(refusals)}, Redis peak {peak[0] / 2**20:.1f} MiB "
        f"(maxmemory {MAXMEMORY / 2**20:.0f}), Retry-After {sorted(set(retry_afters))}"
    )
    assert refusals and set(refusals) <= {(429, "/problems/overloaded"), (503, "/problems/store-full")}
    assert all(1 <= value <= 60 for value in retry_afters)
    assert peak[0] < MAXMEMORY  # within its cap: the budget, not Redis, refused
    assert [doc["status"] for doc in docs] == ["succeeded"] * len(docs)  # every accepted job answered
    assert stack.cpu_worker.alive() and stack.gpu_worker.alive()
    assert budget.WaitingBytes(client, stack.keys).waiting().get(budget.ALL, 0) == 0  # all given back
    assert server.process.poll() is None and client.info("stats")["rejected_connections"] == 0


def test_a_store_near_its_maxmemory_is_said_to_be_full_with_no_exception_text(full_store_stack):
    stack, server = full_store_stack
    client = redis.Redis.from_url(server.url)
    memory, full = api_services(stack.api.app).admission.memory, stack.settings.backpressure.store_full_ratio
    filler = b"x" * (1024 * 1024)
    try:
        for i in range(64):  # until Redis itself refuses writes
            try:
                client.set(f"filler:{i}", filler)
            except redis.exceptions.OutOfMemoryError:
                break
        # The API reads Redis's memory at most once a second (app.admission_readings.RedisMemory): until it saw it.
        wait_until(lambda: memory.share() >= full, 10, what="the API to read Redis's memory as full")
        response = requests.post(
            stack.url("/v1/jobs"),
            data=encode(make_image(64, 48), "JPEG"),
            headers={"Content-Type": "image/jpeg"},
            timeout=30,
        )
        problem = response.json()
        assert response.status_code == 503 and problem["type"] == "/problems/store-full"
        assert problem["detail"] == "the job store is full; retry later"
        assert 1 <= int(response.headers["Retry-After"]) <= 60
        assert "Error" not in response.text and "Traceback" not in response.text
    finally:
        client.delete(*[f"filler:{i}" for i in range(64)])
    wait_until(lambda: memory.share() < full, 10, what="the API to read Redis's memory as freed")
    assert stack.submit(encode(make_image(64, 48), "JPEG")).status_code == 202  # room again: served again
