"""The compose deployment, built and run for real (`make compose-test`; issue 29).

The stack comes up by the README's own CPU command, `docker compose up`: docker-compose.yml as it is, with
generated secrets in the environment and its ports moved by the variables it names (API_PORT, FLOWER_PORT,
PROMETHEUS_PORT), its GPU worker on the CPU (`--device auto`; the image holds a CPU build of torch). One overlay of
the test's own is laid over it: a callback receiver on the stack's network, which the callback workers may reach
by name. Everything else (images, commands, restart policies, the Redis volume, Flower's auth, the secrets check)
is the file's own. The tests run in order, on one deployment, and the module tears down every container, network
and volume it made.

Only `make compose-test` runs this module (it sets IMGSERVE_COMPOSE_TEST and builds the images first); a machine
without a Docker engine fails there, loudly."""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import hmac
import json
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from contract.jobs.record import TERMINAL
from tests.support import REPO_ROOT, free_port, jpeg, wait_until

pytestmark = pytest.mark.compose

PROJECT = "imgserve-compose-test"
RECEIVER = "callback-receiver"
# The README's command for a machine without a GPU (this one): the main file alone, no overlay.
README_CPU_COMMAND = "docker compose up"
README_FILES = ["docker-compose.yml"]
# Each step's longest wait: a 2-core machine builds, starts and restarts containers slowly.
START_S = 180.0
JOB_S = 120.0


@dataclass
class Deployment:
    files: list[Path]  # the README's, then the test's overlay
    env: dict[str, str]  # what compose interpolates: the secrets and ports, as .env would give them
    secrets: dict[str, str]
    api: str
    flower: str
    receiver: str
    prometheus: str | None
    session: requests.Session = field(default_factory=requests.Session)
    project: str = PROJECT

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["docker-compose", "-p", self.project, *(arg for file in self.files for arg in ("-f", str(file))), *args],
            cwd=REPO_ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, f"docker-compose {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).stdout.split()

    def inspect(self, container: str) -> dict[str, Any]:
        done = subprocess.run(["docker", "inspect", container], capture_output=True, text=True, check=True)
        return json.loads(done.stdout)[0]

    def submit(self, data: bytes, **params: str) -> requests.Response:
        return self.session.post(
            f"{self.api}/v1/jobs", data=data, params=params, headers={"Content-Type": "image/jpeg"}, timeout=30
        )

    def submit_ok(self, data: bytes, **params: str) -> str:
        response = self.submit(data, **params)
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def job(self, job_id: str, wait: float = 0) -> dict[str, Any]:
        response = self.session.get(
            f"{self.api}/v1/jobs/{job_id}", params={"wait": wait} if wait else None, timeout=wait + 30
        )
        assert response.status_code == 200, response.text
        return response.json()

    def wait_terminal(self, job_id: str, timeout_s: float = JOB_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                doc = self.job(job_id, wait=min(10.0, max(0.1, deadline - time.monotonic())))
                if doc["status"] in TERMINAL:
                    return doc
            except (requests.ConnectionError, AssertionError):
                pass  # the API answers 503 while Redis restarts
            assert time.monotonic() < deadline, f"job {job_id} did not end within {timeout_s} s"
            time.sleep(0.2)

    @property
    def flower_auth(self) -> tuple[str, str]:
        user, password = self.secrets["FLOWER_BASIC_AUTH"].split(":", 1)
        return user, password

    def flower_tasks(self) -> dict[str, dict[str, Any]]:
        response = requests.get(f"{self.flower}/api/tasks", auth=self.flower_auth, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()


def _generated_secrets() -> dict[str, str]:
    return {
        "REDIS_PASSWORD": secrets.token_urlsafe(24),
        "FLOWER_BASIC_AUTH": "admin:" + secrets.token_urlsafe(24),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(24),
        "IMGSERVE_CALLBACK_SECRET": secrets.token_urlsafe(32),
    }


def _test_overlay(ports: dict[str, int]) -> dict[str, Any]:
    """What the test adds to the README's stack: a callback receiver on its network, admitted by the callback
    workers (and the API, which checks a callback_url when it takes a job)."""
    allowed = json.dumps([f"{RECEIVER}:8080"])
    return {
        "services": {
            "api": {"environment": {"IMGSERVE_CALLBACKS__ALLOW_HOSTS": allowed}},
            "callback-worker": {"environment": {"IMGSERVE_CALLBACKS__ALLOW_HOSTS": allowed}},
            RECEIVER: {
                "image": "imgserve-app",
                "command": ["python", "/receiver.py"],
                "volumes": [f"{Path(__file__).with_name('callback_receiver.py')}:/receiver.py:ro"],
                "ports": [f"127.0.0.1:{ports['receiver']}:8080"],
            },
        }
    }


@pytest.fixture(scope="module")
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    if not os.environ.get("IMGSERVE_COMPOSE_TEST"):
        pytest.fail("run by `make compose-test` (it builds the images and starts the engine)")
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"`{README_CPU_COMMAND}` on any machine" in readme, "the README's CPU command changed: follow it here"
    generated = _generated_secrets()
    ports = {name: free_port() for name in ("api", "flower", "receiver", "prometheus")}
    with_prometheus = bool(os.environ.get("PROMETHEUS_IMAGE"))
    env = {
        **{k: v for k, v in os.environ.items() if k not in generated and k != "COMPOSE_FILE"},
        **generated,
        "API_PORT": str(ports["api"]),
        "FLOWER_PORT": str(ports["flower"]),
        "PROMETHEUS_PORT": str(ports["prometheus"]),
        # Two children per CPU worker: on a 2-core host two workers then run four decodes at once.
        "CPU_WORKER_CONCURRENCY": "2",
        "CPU_WORKER_MEMORY": "1g",
    }
    overlay = tmp_path_factory.mktemp("compose") / "test-overlay.yml"
    overlay.write_text(yaml.safe_dump(_test_overlay(ports), sort_keys=False))
    stack = Deployment(
        [*(REPO_ROOT / name for name in README_FILES), overlay],
        env,
        generated,
        api=f"http://127.0.0.1:{ports['api']}",
        flower=f"http://127.0.0.1:{ports['flower']}",
        receiver=f"http://127.0.0.1:{ports['receiver']}",
        prometheus=f"http://127.0.0.1:{ports['prometheus']}" if with_prometheus else None,
    )
    everything = ("--profile", "monitoring")  # down stops the profile's services too
    stack.compose(*everything, "down", "-v", "--remove-orphans", check=False)  # what an interrupted run left
    failed_before = request.session.testsfailed
    started = False
    try:
        stack.compose("build", timeout=1800)
        stack.compose("up", "-d", timeout=START_S)  # the README's `docker compose up` (detached)
        if with_prometheus:  # Grafana has no local stand-in: only Prometheus of the monitoring profile
            stack.compose("--profile", "monitoring", "up", "-d", "--no-deps", "prometheus", timeout=START_S)
        wait_until(lambda: _ready(stack), START_S, interval_s=0.5, what="the API's /readyz")
        started = True
        yield stack
    finally:
        if not started or request.session.testsfailed > failed_before or os.environ.get("IMGSERVE_COMPOSE_LOGS"):
            print(stack.compose("logs", "--no-color", "--tail", "40", check=False).stdout)  # what CI shows
        down = stack.compose(*everything, "down", "-v", "--remove-orphans", timeout=300, check=False)
        assert down.returncode == 0, down.stderr
        left = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert not left, f"containers left behind: {left}"


def _ready(stack: Deployment) -> bool:
    try:
        return requests.get(f"{stack.api}/readyz", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def _host_pid(stack: Deployment, container: str) -> int:
    return int(stack.inspect(container)["State"]["Pid"])


def test_the_secrets_check_refuses_a_placeholder(deployment: Deployment):
    refused = deployment.compose("run", "--rm", "-e", "REDIS_PASSWORD=changeme", "check-secrets", check=False)
    assert refused.returncode != 0
    assert "REDIS_PASSWORD" in refused.stdout + refused.stderr
    accepted = deployment.compose("run", "--rm", "check-secrets", check=False)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr


def test_readyz_says_every_part_is_up(deployment: Deployment):
    response = requests.get(f"{deployment.api}/readyz", timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["ready"] is True, body


def test_a_job_is_answered_by_poll_and_by_a_signed_callback(deployment: Deployment):
    job_id = deployment.submit_ok(jpeg(640, 480, seed=1), callback_url=f"http://{RECEIVER}:8080/hook")
    doc = deployment.wait_terminal(job_id)
    assert doc["status"] == "succeeded", doc
    assert isinstance(doc["result"]["detections"], list)

    def delivered() -> dict[str, Any] | None:
        posts = requests.get(f"{deployment.receiver}/received", timeout=5).json()
        return next((p for p in posts if p["headers"].get("X-Imgserve-Job-Id") == job_id), None)

    post = wait_until(delivered, JOB_S, interval_s=0.2, what="the callback")
    body = base64.b64decode(post["body"])
    message = f"{post['headers']['X-Imgserve-Timestamp']}.{job_id}.".encode() + body
    expected = (
        "sha256="
        + hmac.new(deployment.secrets["IMGSERVE_CALLBACK_SECRET"].encode(), message, hashlib.sha256).hexdigest()
    )
    assert hmac.compare_digest(post["headers"]["X-Signature"], expected)
    assert json.loads(body)["id"] == job_id and json.loads(body)["status"] == "succeeded"


def test_flower_needs_its_basic_auth_and_shows_the_tasks(deployment: Deployment):
    assert requests.get(f"{deployment.flower}/api/tasks", timeout=10).status_code == 401
    wrong = requests.get(f"{deployment.flower}/api/tasks", auth=("admin", "not-the-password"), timeout=10)
    assert wrong.status_code == 401
    tasks = wait_until(
        lambda: [t for t in deployment.flower_tasks().values() if t.get("state") == "SUCCESS"],
        60,
        interval_s=0.5,
        what="a finished task in Flower",
    )
    assert any(task["name"].endswith("preprocess") for task in tasks)


def test_two_cpu_workers_share_the_jobs(deployment: Deployment):
    deployment.compose("up", "-d", "--no-recreate", "--scale", "cpu-worker=2", "cpu-worker", timeout=START_S)
    assert len(deployment.containers("cpu-worker")) == 2
    containers = deployment.containers("cpu-worker")
    wait_until(
        lambda: all(_consuming(deployment, c) for c in containers),
        START_S,
        interval_s=0.5,
        what="both CPU workers consuming",
    )
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        job_ids = list(pool.map(lambda i: deployment.submit_ok(jpeg(800, 600, seed=100 + i)), range(24)))
        docs = list(pool.map(deployment.wait_terminal, job_ids))
    assert [doc["status"] for doc in docs] == ["succeeded"] * len(job_ids)
    wanted = set(job_ids)
    workers = wait_until(
        lambda: _workers_of(deployment, wanted), 30, interval_s=0.5, what="Flower's record of the jobs' tasks"
    )
    assert len(workers) == 2, workers


def _consuming(stack: Deployment, container: str) -> bool:
    """The worker said it is ready (it consumes from then on), and Flower sees it."""
    logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    name = f"cpu@{container[:12]}"  # the compose file names the CPU workers cpu@<host>
    if f"{name} ready." not in logs.stdout + logs.stderr:
        return False
    workers = requests.get(
        f"{stack.flower}/api/workers", params={"status": "true"}, auth=stack.flower_auth, timeout=10
    ).json()
    return bool(workers.get(name))


def _workers_of(stack: Deployment, job_ids: set[str]) -> set[str] | None:
    seen: dict[str, str] = {}
    for task in stack.flower_tasks().values():
        if task["name"].endswith("preprocess") and task.get("state") == "SUCCESS":
            for job_id in job_ids:
                if job_id in str(task.get("args")):
                    seen[job_id] = task["worker"]
    return set(seen.values()) if len(seen) == len(job_ids) else None


def test_killed_workers_are_restarted_and_no_job_is_lost(deployment: Deployment):
    gpu, cpu = deployment.containers("gpu-worker")[0], deployment.containers("cpu-worker")[0]
    restarts = {c: deployment.inspect(c)["RestartCount"] for c in (gpu, cpu)}
    accepted: list[str] = []
    stop = threading.Event()

    def keep_submitting() -> None:
        seed = 1000
        while not stop.is_set():
            seed += 1
            try:
                response = deployment.submit(jpeg(640, 480, seed=seed))
            except requests.ConnectionError:
                continue
            if response.status_code == 202:
                accepted.append(response.json()["id"])
            time.sleep(0.2)

    submitter = threading.Thread(target=keep_submitting, daemon=True)
    submitter.start()
    try:
        # A burst, so that the workers hold jobs when they die: some queued, some decoding, some in a batch.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            accepted.extend(pool.map(lambda i: deployment.submit_ok(jpeg(1280, 720, seed=2000 + i)), range(16)))
        unfinished = sum(deployment.job(job_id)["status"] not in TERMINAL for job_id in accepted)
        # As a crash would: the container's own first process dies, not `docker kill` (which counts as a
        # stop that restart: unless-stopped respects).
        for container in (gpu, cpu):
            os.kill(_host_pid(deployment, container), signal.SIGKILL)
        for container in (gpu, cpu):
            wait_until(
                lambda c=container: (
                    deployment.inspect(c)["RestartCount"] > restarts[c] and deployment.inspect(c)["State"]["Running"]
                ),
                START_S,
                interval_s=0.5,
                what=f"container {container[:12]} restarted",
            )
        after_restart = len(accepted)
        wait_until(lambda: len(accepted) >= after_restart + 5, 60, what="jobs accepted after the restarts")
    finally:
        stop.set()
        submitter.join(timeout=60)
    assert unfinished > 0, "every job had ended before the kill: the test proved nothing"
    docs = {job_id: deployment.wait_terminal(job_id, timeout_s=JOB_S) for job_id in accepted}
    failed = {job_id: doc for job_id, doc in docs.items() if doc["status"] != "succeeded"}
    assert not failed, failed
    print(
        f"compose kill test: {len(accepted)} accepted, {unfinished} unfinished when both workers were killed, "
        f"{len(docs) - len(failed)} succeeded, 0 lost"
    )


def test_the_redis_volume_outlives_a_restart_and_no_job_is_lost(deployment: Deployment):
    image = jpeg(640, 480, seed=7)
    done_before = [deployment.submit_ok(image, cache="false") for _ in range(3)]
    answers = {job_id: deployment.wait_terminal(job_id) for job_id in done_before}
    assert all(doc["status"] == "succeeded" for doc in answers.values()), answers
    in_flight = [deployment.submit_ok(jpeg(1280, 720, seed=200 + i)) for i in range(8)]
    deployment.compose("restart", "redis", timeout=START_S)
    # A clean shutdown (its AOF flushed), not the SIGKILL that follows a SIGTERM nobody received.
    [redis_container] = deployment.containers("redis")
    redis_log = subprocess.run(["docker", "logs", redis_container], capture_output=True, text=True)
    assert "ready to exit" in redis_log.stdout + redis_log.stderr
    wait_until(lambda: _ready(deployment), START_S, interval_s=0.5, what="/readyz after Redis restarted")
    for job_id, before in answers.items():
        after = deployment.job(job_id)
        assert after["status"] == "succeeded" and after["result"] == before["result"], job_id
    ends = {job_id: deployment.wait_terminal(job_id)["status"] for job_id in in_flight}
    assert set(ends.values()) == {"succeeded"}, ends
    late = deployment.submit_ok(jpeg(640, 480, seed=300))
    assert deployment.wait_terminal(late)["status"] == "succeeded"


def test_prometheus_scrapes_the_api_and_the_gpu_worker(deployment: Deployment):
    if deployment.prometheus is None:
        pytest.skip("no Prometheus image given (scripts/compose-images --monitoring makes a local one)")

    def healthy_jobs() -> set[str] | None:
        targets = requests.get(f"{deployment.prometheus}/api/v1/targets", timeout=10).json()["data"]
        up = {t["labels"]["job"] for t in targets["activeTargets"] if t["health"] == "up"}
        return up if {"api", "gpu-worker"} <= up else None

    assert wait_until(healthy_jobs, 90, interval_s=1.0, what="Prometheus's targets up")
