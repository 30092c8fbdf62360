"""`make run`'s own processes (the Procfile under tools.procfile) keep the service up when one dies, and a
dead CPU worker's tasks come back in seconds, not after kombu's visibility timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator

import pytest
import redis
import requests

from bench.stack.local import ProcfileStack, StackOptions
from bench.stack.processes import REPO_ROOT, children_of, wait_until
from contract.redis.keys import Keys
from tests.support import jpeg
from tests.test_callbacks import Receiver, verify


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """A callback receiver on this machine, on the port make run admits (CALLBACK_RECEIVER_PORT)."""
    receiver = Receiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def make_run(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[ProcfileStack]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CALLBACK_RECEIVER_PORT", str(receiver.port))
        for name in ("IMGSERVE_CALLBACK_SECRET", "IMGSERVE_CALLBACKS__ALLOW_HOSTS"):
            patch.delenv(name, raising=False)
        stack = ProcfileStack(
            tmp_path_factory.mktemp("make-run"),
            StackOptions(device="sim", cpu_workers=2, sim_profile_ms={1: 5.0, 8: 20.0}),
        ).start()
    # Until the service is ready, a process that ends stops everything instead of restarting. The supervisor
    # (run-local's --ready-url) ends that window when /readyz first answers it, and says so after: the ready line.
    wait_until(lambda: "make run: ready at " in supervisor_log(stack), 60, what="make run's ready line")
    yield stack
    stack.stop()


def supervisor_log(stack: ProcfileStack) -> str:
    assert stack.supervisor is not None
    return stack.supervisor.log_tail(200_000)


def pid_of(stack: ProcfileStack, role: str) -> int:
    """The role's own process as the supervisor last started it: past the `sh -c` (and `env`) it runs it in."""
    pid = int(
        re.findall(rf"procfile: {re.escape(role)} (?:started|restarted) \(pid (\d+)\)", supervisor_log(stack))[-1]
    )
    while (
        open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0] in (b"/bin/sh", b"env")
        and len(children := children_of(pid)) == 1
    ):
        pid = next(iter(children))
    return pid


def cpu_worker_ready(stack: ProcfileStack) -> bool:
    return any('"role": "cpu-worker"' in line and "ready." in line for line in supervisor_log(stack).splitlines())


def submit_and_finish(stack: ProcfileStack, seed: int, timeout_s: float = 60.0) -> dict:
    """Submit (retrying while the API is away) and wait for the job's end."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = requests.post(
                f"{stack.url}/v1/jobs",
                data=jpeg(160, 120, seed=seed),
                headers={"Content-Type": "image/jpeg"},
                timeout=10,
            )
            if response.status_code == 202:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "the API never answered again"
        time.sleep(0.2)
    return wait_for_end(stack, response.json()["id"], deadline - time.monotonic())


def wait_for_end(stack: ProcfileStack, job_id: str, timeout_s: float) -> dict:
    def ended() -> dict | None:
        doc = requests.get(f"{stack.url}/v1/jobs/{job_id}", params={"wait": 5}, timeout=15).json()
        return doc if doc["status"] in ("succeeded", "failed", "expired", "cancelled") else None

    return wait_until(ended, max(1.0, timeout_s), interval_s=0.0, what=f"job {job_id} to end")


def held(client: redis.Redis, keys: Keys) -> bool:
    """Whether any Celery worker holds a message (tasks.hop.broker's holds: a worker's hash or its held list)."""
    return any(client.hlen(key) for key in client.scan_iter(keys.celery_holds("*"))) or any(
        client.llen(key) for key in client.scan_iter(keys.celery_held("*"))
    )


def test_a_cpu_worker_killed_with_a_task_in_hand_has_it_served_in_seconds_and_comes_back(make_run):
    assert make_run.redis is not None and make_run.supervisor is not None
    client, keys = redis.Redis(port=make_run.redis.port), Keys("imgserve")
    wait_until(lambda: cpu_worker_ready(make_run), 60, what="the CPU worker to be ready")
    main = pid_of(make_run, "cpu-worker")
    assert b"celery" in open(f"/proc/{main}/cmdline", "rb").read() and children_of(main)
    for child in children_of(main):  # the pool cannot run it: the task stays in the main process's hands
        os.kill(child, signal.SIGSTOP)
    response = requests.post(
        f"{make_run.url}/v1/jobs", data=jpeg(160, 120, seed=1), headers={"Content-Type": "image/jpeg"}, timeout=10
    )
    job_id = response.json()["id"]

    wait_until(lambda: held(client, keys), 20, what="the CPU worker to hold the task")
    killed_at = time.monotonic()
    os.killpg(os.getpgid(main), signal.SIGKILL)  # the main process and its children, as an OOM kill or a lost host
    # would
    doc = wait_for_end(make_run, job_id, 60)
    assert doc["status"] == "succeeded"
    recovered_s = time.monotonic() - killed_at
    print(f"a killed CPU worker's task served {recovered_s:.1f} s after the kill")
    assert recovered_s < 30  # kombu alone: visibility_timeout_s (300) and its restore interval
    log = supervisor_log(make_run)
    assert "cpu-worker ended (status -9)" in log and "cpu-worker restarted" in log
    # The new worker's line: it logs once its beat's reap is over, and the task it gave back may be served (by a
    # worker free meanwhile) before that line has passed through the supervisor's log.
    found = "was found dead: 1 tasks it held are back on their queues"
    wait_until(lambda: found in supervisor_log(make_run), 15, what="the new worker's line on the dead one")
    assert submit_and_finish(make_run, seed=2)["status"] == "succeeded"


def test_a_cpu_worker_killed_as_it_takes_a_task_from_redis_has_the_task_sent_again(make_run):
    """Kombu's BRPOP takes a message off its queue before the worker records it as held: a worker killed between
    the two takes the message with it (the compose kill test met it: a job expired). Here the CPU worker's main
    process is stopped while its BRPOP waits, so Redis hands the next task to a process that will never read it;
    then it is killed. tasks.hop.lost_deliveries finds the job's task nowhere and sends it again."""
    assert make_run.redis is not None
    client, keys = redis.Redis(port=make_run.redis.port), Keys("imgserve")
    wait_until(lambda: cpu_worker_ready(make_run), 60, what="the CPU worker to be ready")
    wait_until(lambda: not held(client, keys), 30, what="the CPU worker to hold nothing")
    main = pid_of(make_run, "cpu-worker")
    for attempt in range(3):
        os.kill(main, signal.SIGSTOP)
        response = requests.post(
            f"{make_run.url}/v1/jobs",
            data=jpeg(160, 120, seed=10 + attempt),
            headers={"Content-Type": "image/jpeg"},
            timeout=10,
        )
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        queue = keys.celery_queue(client.hget(keys.job(job_id), "queue").decode())
        # Handed to the stopped process's BRPOP (its socket holds it), or still on the queue if the stop came
        # between two BRPOPs: then the worker takes it as usual, and another try.
        try:
            wait_until(lambda: client.llen(queue) == 0, 2.0, what="the task handed to the stopped BRPOP")
            break
        except AssertionError:
            pass
        os.kill(main, signal.SIGCONT)
        assert wait_for_end(make_run, job_id, 60)["status"] == "succeeded"
    else:
        pytest.fail("the stopped worker never had a BRPOP waiting")
    assert not held(client, keys)  # nobody holds it: the reaper cannot give it back
    os.killpg(os.getpgid(main), signal.SIGKILL)
    doc = wait_for_end(make_run, job_id, 60)
    assert doc["status"] == "succeeded", doc
    assert client.hget(keys.job(job_id), "resent") == b"1"
    assert f"job {job_id}'s task was in no queue and in no worker's hands" in supervisor_log(make_run)


@pytest.mark.parametrize("role", ["gpu-worker", "api", "flower", "callback-worker"])
def test_every_other_role_killed_comes_back_and_the_service_answers_again(make_run, role):
    before = supervisor_log(make_run).count(f"{role} restarted")
    killed_at = time.monotonic()
    os.kill(pid_of(make_run, role), signal.SIGKILL)
    wait_until(lambda: supervisor_log(make_run).count(f"{role} restarted") > before, 60, what=f"{role} to be restarted")
    restarted_s = time.monotonic() - killed_at
    assert submit_and_finish(make_run, seed=3)["status"] == "succeeded"
    served_s = time.monotonic() - killed_at
    print(f"{role}: restarted {restarted_s:.1f} s after the kill, a job served {served_s:.1f} s after")
    if role == "flower":

        def flower_answers() -> bool:
            try:
                return (
                    requests.get(
                        f"http://127.0.0.1:{make_run.env['FLOWER_PORT']}/healthcheck",
                        auth=tuple(make_run.env["FLOWER_BASIC_AUTH"].split(":", 1)),
                        timeout=5,
                    ).status_code
                    == 200
                )
            except requests.RequestException:
                return False

        wait_until(flower_answers, 60, what="Flower to answer again")


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses something listens on at this port (from /proc/net/tcp: state 0A)."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_flower_needs_its_credentials_and_the_gpu_metrics_stay_on_this_machine(make_run):
    """Flower under make run took task-applies from any page a browser opened, and listed every tenant's jobs."""
    flower = f"http://127.0.0.1:{make_run.env['FLOWER_PORT']}"
    user, _, password = make_run.env["FLOWER_BASIC_AUTH"].partition(":")
    wait_until(
        lambda: requests.get(flower + "/healthcheck", auth=(user, password), timeout=5).status_code == 200,
        60,
        what="Flower to answer",
    )
    # Issue 52: /metrics (every task's counts) and /healthcheck answered anyone; an unknown path said 404.
    for path in ("/metrics", "/healthcheck", "/no-such-page"):
        assert requests.get(flower + path, timeout=10).status_code == 401, path
        assert requests.get(flower + path, auth=(user, "wrong"), timeout=10).status_code == 401, path
    assert "flower_events_total" in requests.get(flower + "/metrics", auth=(user, password), timeout=10).text
    anonymous = requests.get(flower + "/api/tasks", timeout=10)
    forged = requests.post(
        flower + "/api/task/async-apply/imgserve.callback",
        data='{"args": ["x"]}',
        headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
        timeout=10,
    )
    assert anonymous.status_code == 401 and forged.status_code in (401, 403)
    assert requests.get(flower + "/api/workers", auth=(user, password), timeout=30).status_code == 200
    # Pages a newcomer's links name: the Broker tab (404 on this project's transport before) and Flower 1's
    # /dashboard (now the workers page).
    assert requests.get(flower + "/broker", auth=(user, password), timeout=30).status_code == 200
    dashboard = requests.get(flower + "/dashboard", auth=(user, password), timeout=30)
    assert dashboard.status_code == 200 and dashboard.url.endswith("/workers")
    assert listening_addresses(int(make_run.env["GPU_METRICS_PORT"])) == {"127.0.0.1"}
    # Issue 61: the autoscaler's signal, per model, for Prometheus (and KEDA through it)
    gpu_metrics = f"http://127.0.0.1:{make_run.env['GPU_METRICS_PORT']}/metrics"
    page = wait_until(
        lambda: "imgserve_cpu_workers_wanted{" in (text := requests.get(gpu_metrics, timeout=10).text) and text,
        30,
        what="the GPU worker's first backlog export",
    )
    for where in ("queued", "held", "frames"):
        line = f'imgserve_backlog{{model="shapes-yolo",version="2.0.0",where="{where}"}}'  # labels sorted
        assert line in page, [found for found in page.splitlines() if found.startswith("imgserve_backlog")]


def test_flower_finds_a_job_by_its_id(make_run):
    """Issue 53: the Celery task id in Flower was a uuid of its own, so a job could not be found there by the id a
    client holds. The preprocess task's id is the job id; its callback's is the job id and `-callback`."""
    flower = f"http://127.0.0.1:{make_run.env['FLOWER_PORT']}"
    user, _, password = make_run.env["FLOWER_BASIC_AUTH"].partition(":")
    doc = submit_and_finish(make_run, seed=20)
    assert doc["status"] == "succeeded"

    def task_info() -> dict | None:
        response = requests.get(f"{flower}/api/task/info/{doc['id']}", auth=(user, password), timeout=10)
        return response.json() if response.status_code == 200 else None

    info = wait_until(task_info, 60, what="Flower to know the job's task by the job id")
    assert info["name"] == "imgserve.preprocess" and info["uuid"] == doc["id"], info


def test_the_start_is_quiet_and_every_line_is_the_supervisors_or_json(make_run):
    """Issue 53: a start printed two Celery banners, two "running as root" SecurityWarnings, two gevent warnings,
    Flower's banner and four "Inspect method ... failed" lines among the JSON. Now every line a process writes is
    JSON, a few per process (logs.verbose brings the chatter back), and a failure's line names its error code."""
    submit_and_finish(make_run, seed=21)
    failed = requests.post(
        f"{make_run.url}/v1/jobs?wait=20", data=b"\xff\xd8\xff" + bytes(200), headers={"Content-Type": "image/jpeg"}
    ).json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "decode_error"
    lines = supervisor_log(make_run).splitlines()

    def failure_line() -> dict | None:
        for line in supervisor_log(make_run).splitlines():
            if line.startswith("{") and failed["id"] in line and "preprocess" in line:
                return json.loads(line)
        return None

    line = wait_until(failure_line, 30, what="the failure's log line")
    assert line["msg"] == "preprocess failed: decode_error" and line["error_code"] == "decode_error", line
    ours = ("procfile:", "run-local:", "bootstrap:", "make run: ready", "  Flower at", "  GPU worker", "  Ctrl-C")
    # The start, up to the ready line (later, the kills of this module's other tests leave sh's "Killed").
    start = supervisor_log(make_run).split("make run: ready at", 1)[0].splitlines()
    strays = [line for line in start if line.strip() and not line.startswith(ours) and not _is_json(line)]
    assert not strays, strays[:20]
    ready = [json.loads(line)["role"] for line in lines if _is_json(line) and "ready." in line]
    assert set(ready) == {"callback-worker", "cpu-worker"}


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def test_callbacks_work_out_of_the_box_signed_with_a_secret_of_its_own(make_run, receiver):
    """Issue 60: under make run a callback_url was a 400 until two settings were added. make run makes a secret
    once (var/callback-secret, mode 600, as Flower's credentials) and admits one port of this machine."""
    secret_file = REPO_ROOT / "var" / "callback-secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = secret_file.read_text().strip()
    assert len(secret) >= 32
    assert "Callbacks (callback_url=...): signed with the secret in var/callback-secret" in supervisor_log(make_run)
    response = requests.post(
        f"{make_run.url}/v1/jobs",
        params={"callback_url": receiver.url},
        data=jpeg(160, 120, seed=31),
        headers={"Content-Type": "image/jpeg"},
        timeout=10,
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    call = wait_until(
        lambda: next((c for c in receiver.calls if c["headers"].get("X-Imgserve-Job-Id") == job_id), None),
        60,
        what="the job's callback",
    )
    assert verify(secret, call["headers"], call["body"], max_age_s=300)
    # Another port of this machine is not admitted: the receiver's port only, not every local service.
    other = requests.post(
        f"{make_run.url}/v1/jobs",
        params={"callback_url": f"http://127.0.0.1:{receiver.port + 1}/hook"},
        data=jpeg(160, 120, seed=32),
        headers={"Content-Type": "image/jpeg"},
        timeout=10,
    )
    assert other.status_code == 400 and "callback_url" in other.text, other.text
