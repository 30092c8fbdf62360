"""Fixtures: a private redis-server on a free port (never the machine's shared
Redis), and a whole running stack of real processes on top of it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import yaml
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from bench.stack.processes import api_argv, cpu_worker_argv, gpu_worker_argv
from contract.jobs.record import TERMINAL
from contract.redis.keys import Keys
from contract.settings.config import load_settings
from tests.support import (
    REPO_ROOT,
    ApiServer,
    ManagedProcess,
    RedisServer,
    answers_200,
    build_content_box_model,
    callback_worker_argv,
    free_port,
    stop_together,
    wait_until,
)

# tests/compose builds and runs Docker images: only `make compose-test` (which sets this) collects it.
collect_ignore = [] if os.environ.get("IMGSERVE_COMPOSE_TEST") else ["compose"]

STACK_INPUT_SIZE = 320
# The integration stacks' GPU worker device: cpu here; IMGSERVE_TEST_DEVICE=cuda runs them on a GPU.
TEST_DEVICE = os.environ.get("IMGSERVE_TEST_DEVICE", "cpu")
CALLBACK_SECRET = "test-callback-secret"
SHAPES_SPEC = REPO_ROOT / "configs" / "models" / "shapes-yolo.yaml"
STACK_MAX_UPLOAD = 3 * 1024 * 1024

# Property tests check what code does, not how fast: on a shared 2-core machine a first draw can take
# over a second while other tests' processes start, which Hypothesis would report as a failure.
hypothesis_settings.register_profile("shared-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile("shared-machine")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on a database of its own, emptied before the test."""
    client = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/1")
    client.flushdb()
    yield client
    client.close()


@dataclass
class Stack:
    """API + Celery CPU worker + GPU worker, all real, sharing one private Redis."""

    config_path: Path
    log_dir: Path
    env: dict[str, str]
    api: ApiServer
    redis: redis.Redis
    keys: Keys
    settings: Any
    cpu_worker: ManagedProcess
    callback_worker: ManagedProcess | None = None
    gpu_worker: ManagedProcess | None = None
    gpu_worker_id: str = "test-gpu"
    gpu_device: str = TEST_DEVICE
    gpu_models: tuple[str, ...] = ()  # --model arguments of the stack's GPU worker (none: every model)
    session: requests.Session = field(default_factory=requests.Session)

    def url(self, path: str) -> str:
        return self.api.url + path

    @property
    def frames_key(self) -> str:
        """The (default) model's frame list."""
        return self.keys.frames(self.settings.model.key)

    def submit(self, data: bytes, content_type: str = "image/jpeg", **options: Any) -> requests.Response:
        return self.session.post(
            self.url("/v1/jobs"),
            files={"image": ("image", data, content_type)},
            data={k: str(v) for k, v in options.items()},
            timeout=30,
        )

    def submit_ok(self, data: bytes, **options: Any) -> str:
        response = self.submit(data, **options)
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def job(self, job_id: str, wait: float = 0) -> dict[str, Any]:
        response = self.session.get(
            self.url(f"/v1/jobs/{job_id}"), params={"wait": wait} if wait else None, timeout=wait + 30
        )
        assert response.status_code == 200, response.text
        return response.json()

    def wait_terminal(self, job_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            doc = self.job(job_id, wait=min(10.0, max(0.1, deadline - time.monotonic())))
            if doc["status"] in TERMINAL:
                return doc
            assert time.monotonic() < deadline, f"job {job_id} still {doc['status']}\n{self.logs()}"

    def start_gpu_worker(self) -> None:
        assert self.gpu_worker is None or not self.gpu_worker.alive()
        self.gpu_worker = ManagedProcess(
            "gpu-worker",
            gpu_worker_argv(self.gpu_device, self.gpu_worker_id, tuple(self.gpu_models)),
            self.env,
            self.log_dir,
        )
        wait_until(
            lambda: self.redis.exists(self.keys.heartbeat(self.gpu_worker_id)) or self._gpu_died(),
            60,
            what="the GPU worker's first heartbeat",
        )
        assert self.gpu_worker.alive(), self.gpu_worker.log_tail()

    def restart_cpu_worker(self) -> None:
        """A new CPU worker process after the last one ended (as a supervisor starts one after a death)."""
        assert not self.cpu_worker.alive()
        self.cpu_worker = ManagedProcess("cpu-worker", stack_cpu_worker_argv(), self.env, self.log_dir)
        wait_until(lambda: "ready." in self.cpu_worker.log_tail() or not self.cpu_worker.alive(), 60, what="ready")
        assert self.cpu_worker.alive(), self.cpu_worker.log_tail()

    def stop_gpu_worker(self) -> None:
        if self.gpu_worker is not None:
            self.gpu_worker.stop()
            self.gpu_worker = None

    def _gpu_died(self) -> bool:
        return self.gpu_worker is not None and not self.gpu_worker.alive()

    def logs(self) -> str:
        parts = [f"--- {p.name}\n{p.log_tail()}" for p in (self.cpu_worker, self.gpu_worker) if p]
        return "\n".join(parts)


def content_box_spec(workdir: Path, input_size: int, **extra: Any) -> dict[str, Any]:
    """A model spec for the known-answer detector, its TorchScript file written into workdir."""
    model_path = workdir / "content_box.pt"
    build_content_box_model(num_classes=2).save(str(model_path))
    return {
        "name": "content-box",
        "version": "test",
        "format": "torchscript",
        "path": str(model_path),
        "input_size": input_size,
        "layout": "yolov8",
        "labels": ["content", "other"],
        **extra,
    }


def stack_cpu_worker_argv(*more: str) -> list[str]:
    """A test stack's CPU worker: two children (unless `more` says otherwise), without gossip and mingle (no
    cluster to talk to)."""
    return cpu_worker_argv(2, *more, loglevel="INFO")


def start_stack(
    redis_url: str,
    workdir: Path,
    model: dict[str, Any] | str | None,
    namespace: str,
    extra: dict[str, Any] | None = None,
    gpu_device: str = TEST_DEVICE,
    gpu_models: tuple[str, ...] = (),
    cpu_worker_args: tuple[str, ...] = (),
    env_extra: dict[str, str] | None = None,
) -> Stack:
    """API + Celery worker + GPU worker for one model (or, with `models` in `extra` and model None, several),
    under their own namespace."""
    config = {
        "redis_url": redis_url,
        "namespace": namespace,
        **({"model": model} if model is not None else {}),
        "gpu_worker": {"heartbeat_ttl_s": 5},
        # Off unless a test turns it on (tests/test_cache.py): the tests send the same few images again
        # and again, and each must reach the CPU and GPU workers.
        "cache": {"enabled": False},
        "callbacks": {
            "secret": CALLBACK_SECRET,
            "allow_hosts": ["127.0.0.1"],
            "backoff_base_s": 0.2,
            "max_attempts": 3,
            "timeout_s": 2.0,
        },
        **(extra or {}),
    }
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "IMGSERVE_CONFIG": str(config_path), "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env.pop("IMGSERVE_REDIS_URL", None)
    settings = load_settings(config_path)
    from app import create_app

    # Each stack's Celery queue lives in its own Redis database, so two stacks never share tasks.
    cpu_worker = ManagedProcess("cpu-worker", stack_cpu_worker_argv(*cpu_worker_args), env, workdir)
    stack = Stack(
        config_path=config_path,
        log_dir=workdir,
        env=env,
        api=ApiServer(create_app(settings)),
        redis=redis.Redis.from_url(redis_url),
        keys=Keys(settings.namespace),
        settings=settings,
        cpu_worker=cpu_worker,
        gpu_worker_id=f"{namespace}-gpu",
        gpu_device=gpu_device,
        gpu_models=gpu_models,
    )
    stack.callback_worker = ManagedProcess(
        "callback-worker",
        callback_worker_argv(),
        env,
        workdir,
    )
    for worker in (cpu_worker, stack.callback_worker):
        wait_until(lambda: "ready." in worker.log_tail() or not worker.alive(), 60, what=f"{worker.name} to be ready")
        assert worker.alive(), worker.log_tail()
    stack.start_gpu_worker()
    return stack


def stop_stack(stack: Stack) -> None:
    stop_together([p for p in (stack.gpu_worker, stack.cpu_worker, stack.callback_worker) if p is not None])
    stack.gpu_worker = None
    stack.api.stop()


@pytest.fixture(scope="session")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The pipeline serving a detector with a known answer: one box around the whole original image."""
    workdir = tmp_path_factory.mktemp("stack")
    model = content_box_spec(workdir, STACK_INPUT_SIZE, weights="test fixture", conf=0.25, iou=0.45, max_det=10)
    stack = start_stack(
        redis_server.url,
        workdir,
        model,
        "itest",
        {"api": {"max_upload_bytes": STACK_MAX_UPLOAD, "body_timeout_s": 2.0}},
    )
    yield stack
    stop_stack(stack)


@dataclass
class GunicornApi:
    process: ManagedProcess
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def gunicorn_api(stack: Stack) -> Iterator[GunicornApi]:
    """The stack's API as users run it: gunicorn with configs/gunicorn.conf.py, one worker."""
    port = free_port()
    env = {**stack.env, "IMGSERVE_API__BIND": f"127.0.0.1:{port}", "IMGSERVE_API__WORKERS": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    process = ManagedProcess(
        "gunicorn-api",
        api_argv(access_log=False),
        env,
        stack.log_dir,
    )
    api = GunicornApi(process, port)
    wait_until(lambda: answers_200(api.url + "/healthz") or not process.alive(), 60, what="gunicorn to answer")
    assert process.alive(), process.log_tail()
    yield api
    process.stop()


@pytest.fixture(scope="module")
def shapes_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The pipeline serving the shipped default model (configs/models/shapes-yolo.yaml)."""
    url = redis_server.url.rsplit("/", 1)[0] + "/2"
    stack = start_stack(url, tmp_path_factory.mktemp("shapes"), str(SHAPES_SPEC), "shapes")
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def tight_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The content-box pipeline with tiny backpressure limits, to overload on purpose."""
    workdir = tmp_path_factory.mktemp("tight")
    model = content_box_spec(workdir, 64)
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    stack = start_stack(url, workdir, model, "tight", {"backpressure": {"max_frames": 4, "max_backlog": 8}})
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def own_redis_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RedisServer]]:
    """A stack on a Redis of its own (append-only, fsync always) that a test may stop and restart."""
    workdir = tmp_path_factory.mktemp("own-redis")
    server = RedisServer(workdir, persistent=True)
    model = content_box_spec(workdir, 64)
    stack = start_stack(server.url, workdir, model, "ownredis", {"redis": {"timeout_s": 0.5}})
    yield stack, server
    stop_stack(stack)
    server.stop()


# Fixtures that start real processes (Redis, Celery, the GPU worker, gunicorn): a test using one is an
# integration test whether or not its module says so; `make test-fast` runs the others.
PROCESS_FIXTURES = {
    "redis_server",
    "redis_client",
    "stack",
    "gunicorn_api",
    "shapes_stack",
    "tight_stack",
    "own_redis_stack",
    "make_run",
    "full_store_stack",
    "fencing_stack",
}


# The files that took longest in CI (its "slowest files" report, 2026-12-07), longest first. They run first: each
# pytest process takes whole files in collection order (--dist loadfile), and in the alphabet's order most of them
# came last, where one process ran a two-minute file while the other had nothing left.
LONGEST_FILES = (
    "test_models.py",
    "test_reliability.py",
    "test_gpu_fairness.py",
    "test_partitions.py",
    "test_export_layouts.py",
    "test_failover.py",
    "test_hostile_decode_memory.py",
    "test_gpu_accelerated.py",
    "test_make_run.py",
    "test_deploy_files.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
    first = {name: rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order


# Each test file's time (setup, call and teardown of its tests, its module fixtures with them), summed where the
# reports arrive (with xdist: the controller): a file is what one pytest process runs whole (--dist loadfile), so
# these are what CI's time is balanced from, printed at the end beside pytest's slowest tests.
FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    slowest = sorted(FILE_SECONDS.items(), key=lambda item: item[1], reverse=True)[:15]
    if not slowest or slowest[0][1] < 1.0:
        return
    terminalreporter.write_sep("=", f"slowest 15 files of {len(FILE_SECONDS)} (setup, call, teardown summed)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
