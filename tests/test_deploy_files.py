"""The compose file and the Procfile describe the same processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from tests.support import REPO_ROOT, free_port, wait_until
from tools import kubernetes_cells
from tools.redis_config import redis_config_args

SECRETS = {
    "REDIS_PASSWORD": "test-redis-secret-8f2Kq",
    "FLOWER_BASIC_AUTH": "admin:test-flower-secret-x9",
    "GRAFANA_ADMIN_PASSWORD": "test-grafana-secret-p4",
}


# What compose reads besides the files: a reader's own .env (the README's Docker step makes one) and these
# variables. The tests give compose an env file of their own, empty, and none of these from their environment,
# so a .env with the reader's secrets or images changes no verdict (issue 60.5).
COMPOSE_INPUTS = frozenset(
    {
        *SECRETS,
        *re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", (REPO_ROOT / ".env.example").read_text(), re.M),
        "COMPOSE_FILE",
        "COMPOSE_PROFILES",
        "COMPOSE_PROJECT_NAME",
    }
)
NO_ENV_FILE = REPO_ROOT / "tests" / "compose" / "no-dotenv.env"  # comments only


def compose_config(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`docker-compose config` with exactly `env` on top of this process's environment, whatever .env says."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (scripts/bootstrap --dev installs it)")
    clean = {k: v for k, v in os.environ.items() if k not in COMPOSE_INPUTS}
    return subprocess.run(
        ["docker-compose", "--env-file", str(NO_ENV_FILE), *args, "config"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**clean, **env},
    )


@pytest.fixture(scope="module")
def compose() -> dict:
    result = compose_config(SECRETS, "--profile", "monitoring")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_refuses_to_start_without_its_secrets():
    result = compose_config({})
    assert result.returncode != 0 and "REDIS_PASSWORD" in result.stderr


def test_compose_protects_redis_and_flower_and_keeps_their_secrets_off_command_lines(compose):
    services = compose["services"]
    assert "requirepass" in " ".join(services["redis"]["command"])
    assert services["redis"]["environment"]["REDIS_PASSWORD"] == SECRETS["REDIS_PASSWORD"]
    assert services["api"]["environment"]["IMGSERVE_REDIS_URL"].startswith(f"redis://:{SECRETS['REDIS_PASSWORD']}@")
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"] == SECRETS["FLOWER_BASIC_AUTH"]
    for name, service in services.items():
        command = " ".join(service.get("command") or [])
        assert not any(secret in command for secret in SECRETS.values()), name


def test_only_the_api_is_published_beyond_this_host(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}"
            assert name == "api" or published.startswith("127.0.0.1:"), (name, port)


def test_every_service_waits_for_the_secrets_check(compose):
    services = compose["services"]
    assert services["check-secrets"]["command"][:3] == ["python", "-m", "contract.settings.check_secrets"]
    for name, service in services.items():
        if name != "check-secrets":
            assert service["depends_on"]["check-secrets"]["condition"] == "service_completed_successfully", name


def test_the_env_example_copied_unchanged_does_not_start():
    values = dict(
        line.split("=", 1)
        for line in (REPO_ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert compose_config(values).returncode != 0
    from contract.settings.check_secrets import problems

    assert problems(["REDIS_PASSWORD", "FLOWER_BASIC_AUTH", "GRAFANA_ADMIN_PASSWORD"], values)


@pytest.mark.parametrize(
    "env,ok",
    [
        ({"REDIS_PASSWORD": "change-me-to-a-long-random-string"}, False),
        ({"REDIS_PASSWORD": "short"}, False),
        ({"REDIS_PASSWORD": "Xq7-3pLk_vR92mZt8sWd"}, True),
        ({"REDIS_PASSWORD": "Xq7-3pLk_vR92mZt8sWd", "FLOWER_BASIC_AUTH": "admin:change-me"}, False),
        ({"REDIS_PASSWORD": "Xq7-3pLk_vR92mZt8sWd", "FLOWER_BASIC_AUTH": "admin:Xq7-3pLk_vR92mZt8sWd"}, True),
        ({}, False),
    ],
)
def test_the_secrets_check_refuses_placeholders_and_short_secrets(env, ok):
    names = ["REDIS_PASSWORD"] + (["FLOWER_BASIC_AUTH"] if "FLOWER_BASIC_AUTH" in env else []) + ["CALLBACK?"]
    result = subprocess.run(
        [sys.executable, "-m", "contract.settings.check_secrets", *names],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode == 0) is ok, result.stderr
    assert ok or "refusing to start" in result.stderr


def test_monitoring_profile_brings_prometheus_and_grafana(compose):
    assert compose["services"]["prometheus"]["profiles"] == ["monitoring"]
    assert compose["services"]["grafana"]["profiles"] == ["monitoring"]
    scrape = yaml.safe_load((REPO_ROOT / "monitoring" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    api = compose["services"]["api"]
    metrics_port = str(api["environment"]["IMGSERVE_API__METRICS_PORT"])
    gpu_command = compose["services"]["gpu-worker"]["command"]
    gpu_port = gpu_command[gpu_command.index("--metrics-port") + 1]
    assert targets == {f"api:{metrics_port}", f"gpu-worker:{gpu_port}"}
    # Scraped over the internal network; never published beside the API's port.
    assert metrics_port in {str(p) for p in api["expose"]}
    assert all(
        str(p.get("target", p) if isinstance(p, dict) else p).split(":")[-1] != metrics_port for p in api["ports"]
    )


def exported_sample_names() -> set[str]:
    """Every sample name the API and the GPU worker can export."""
    from prometheus_client import REGISTRY

    import app.metrics  # noqa: F401
    import gpu_worker.metrics  # noqa: F401

    names = set()
    for family in REGISTRY.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        names |= {family.name + suffix for suffix in suffixes}
    return names


def test_dashboard_parses_and_every_metric_it_uses_exists():
    dashboard = json.loads((REPO_ROOT / "monitoring" / "grafana" / "dashboards" / "imgserve.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in expressions for name in re.findall(r"imgserve_[a-z_]+", expr)}
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"GPU busy %", "Batch size", "Queue depths"} <= titles
    assert used and used <= exported_sample_names(), used - exported_sample_names()


def test_compose_file_is_valid_and_has_every_service(compose):
    assert set(compose["services"]) >= {
        "check-secrets",
        "redis",
        "api",
        "cpu-worker",
        "callback-worker",
        "gpu-worker",
        "flower",
        "prometheus",
        "grafana",
    }


def test_compose_redis_keeps_an_append_only_file(compose):
    assert "--appendonly yes" in " ".join(compose["services"]["redis"]["command"])
    # Rewritten at 512 MB: at Redis's default 64 the uploads passing through forced a rewrite every ~3 s.
    assert "--auto-aof-rewrite-min-size 512mb" in " ".join(compose["services"]["redis"]["command"])
    assert "--maxmemory-policy noeviction" in " ".join(compose["services"]["redis"]["command"])  # never evicts jobs


def test_the_main_file_runs_anywhere_and_the_gpu_overlay_gives_the_worker_the_gpu(compose):
    """Issue 53: `docker compose up` stopped at "could not select device driver nvidia" on a machine without the
    NVIDIA toolkit. The main file reserves no device (its GPU worker: auto, the CPU there); docker-compose.gpu.yml
    adds the reservation and names cuda, over the main file and over the Sentinel overlay alike."""
    gpu_worker = compose["services"]["gpu-worker"]
    assert "deploy" not in gpu_worker and gpu_worker["command"][-2:] == ["--device", "auto"]
    for files in (["docker-compose.yml", "docker-compose.gpu.yml"], ["docker-compose.yml", "docker-compose.ha.yml"]):
        files = files if "gpu" in files[-1] else [*files, "docker-compose.gpu.yml"]
        result = compose_config(SECRETS, *(arg for name in files for arg in ("-f", name)))
        assert result.returncode == 0, result.stderr
        merged = yaml.safe_load(result.stdout)["services"]["gpu-worker"]
        [device] = merged["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], files
        assert merged["command"][-2:] == ["--device", "cuda"], files
    assert "docker compose -f docker-compose.yml -f docker-compose.gpu.yml up" in (REPO_ROOT / "README.md").read_text()
    assert "COMPOSE_FILE=docker-compose.yml:docker-compose.gpu.yml" in (REPO_ROOT / ".env.example").read_text()


def test_compose_cpu_workers_scale_freely(compose):
    worker = compose["services"]["cpu-worker"]
    assert "ports" not in worker and "container_name" not in worker
    assert "-Q preprocess" in " ".join(worker["command"])
    assert "--max-memory-per-child" in " ".join(worker["command"]) and worker["mem_limit"]


def test_the_callback_worker_has_a_stable_node_name_and_cpu_workers_unique_ones(compose):
    """Flower named the callback worker by its container's id (`callbacks@d9b87fd09691`), new at each restart.
    A scaled service cannot have one hostname: its replicas would share a node name, so the CPU workers keep
    the container's."""
    callbacks, cpu = compose["services"]["callback-worker"], compose["services"]["cpu-worker"]
    assert callbacks["hostname"] == "callback-worker" and "callbacks@%h" in callbacks["command"]
    assert "hostname" not in cpu and "-n cpu@%h" in " ".join(cpu["command"])


def test_procfile_runs_the_same_roles_without_docker():
    roles = dict(line.split(":", 1) for line in (REPO_ROOT / "Procfile").read_text().splitlines() if line)
    assert set(roles) == {"api", "cpu-worker", "callback-worker", "gpu-worker", "flower"}
    assert "-Q callbacks" in roles["callback-worker"]
    assert "-Q preprocess" in roles["cpu-worker"] and "--port=${FLOWER_PORT:-5555}" in roles["flower"]


def test_flower_keeps_a_bounded_number_of_tasks_in_both(compose):
    """Flower's default keeps 100,000 tasks (~460 MB at the story's 15 jobs/s, growing for two hours): both ways
    of running it bound the list to the same figure (docs/operations.md)."""
    procfile = dict(line.split(":", 1) for line in (REPO_ROOT / "Procfile").read_text().splitlines() if line)
    assert "--max_tasks=${FLOWER_MAX_TASKS:-10000}" in procfile["flower"]
    assert "--max_tasks=10000" in compose["services"]["flower"]["command"]


def copied_paths(stage: str) -> set[str]:
    """What the Dockerfile copies into a stage, its base stages included."""
    stages: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            parts = line.split()
            current = parts[-1]
            stages[current] = (parts[1], [])
        elif line.startswith("COPY ") and current:
            stages[current][1].extend(line.split()[1:-1])
    copied: set[str] = set()
    while stage in stages:
        base, sources = stages[stage]
        copied.update(sources)
        stage = base
    return copied


def test_each_image_holds_what_its_role_loads():
    from contract.settings.config import load_settings

    weights = Path(load_settings(REPO_ROOT / "configs" / "default.yaml").model.path).resolve()
    top_level = weights.relative_to(REPO_ROOT).parts[0]
    assert top_level in copied_paths("gpu-worker")
    assert {"contract", "app", "tasks", "configs"} <= copied_paths("app")


def test_the_gpu_worker_runs_without_pillow_which_its_image_does_not_install():
    import subprocess
    import sys

    probe = (
        "import sys; sys.modules['PIL'] = None\n"
        "import gpu_worker.__main__, gpu_worker.worker, gpu_worker.devices, gpu_worker.simulated"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    gpu_stage = (REPO_ROOT / "Dockerfile").read_text().split("AS gpu-worker", 1)[1]
    assert "pillow" not in gpu_stage.lower()


def test_the_dashboard_selects_models_and_every_per_model_panel_follows_the_selector():
    dashboard = json.loads((REPO_ROOT / "monitoring" / "grafana" / "dashboards" / "imgserve.json").read_text())
    [selector] = [variable for variable in dashboard["templating"]["list"] if variable["name"] == "model"]
    assert selector["includeAll"] and selector["multi"]
    per_model = (
        "imgserve_gpu_batch",
        "imgserve_stage_seconds",
        "imgserve_queue_depth",
        "imgserve_backlog",
        "imgserve_cpu_workers_wanted",
        "imgserve_gpu_frames",
        "imgserve_api_jobs_submitted",
    )
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    model_expressions = [expr for expr in expressions if any(name in expr for name in per_model)]
    assert model_expressions and all('model=~"$model"' in expr for expr in model_expressions)


def test_the_dashboard_selects_cells_and_each_gpu_workers_panel_follows_and_splits_by_cell():
    """Cells (docs/running-cells.md): each cell's GPU workers are scraped with a `cell` label. Every series a GPU
    worker exports is filtered by the cell selector (all cells by default; with one cell, the label is absent and
    `.*` still matches), and the per-cell panels draw one line a cell."""
    dashboard = json.loads((REPO_ROOT / "monitoring" / "grafana" / "dashboards" / "imgserve.json").read_text())
    [selector] = [variable for variable in dashboard["templating"]["list"] if variable["name"] == "cell"]
    assert selector["includeAll"] and selector["multi"] and selector["allValue"] == ".*"
    assert "cell)" in selector["definition"] and "imgserve_gpu_busy_ratio" in selector["definition"]
    exported_by_gpu_workers = ("imgserve_gpu_", "imgserve_queue_depth", "imgserve_backlog", "imgserve_cpu_workers")
    per_cell = {"GPU busy %", "Batch size", "Queue depths", "Backlog and the CPU worker processes it wants"}
    assert per_cell <= {panel["title"] for panel in dashboard["panels"]}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            if any(name in target["expr"] for name in exported_by_gpu_workers):
                assert 'cell=~"$cell"' in target["expr"], target["expr"]
            if panel["title"] in per_cell:
                assert "by (" not in target["expr"] or re.search(r"by \((le, )?cell,", target["expr"]), target["expr"]
                assert "{{cell}}" in target["legendFormat"]


def test_every_image_can_be_swapped_for_a_local_stand_in():
    """Where registries are out of reach: the service images' base and torch index are build arguments, and
    Redis's and the monitoring images are variables; the defaults are the public images."""
    local = {
        "BASE_IMAGE": "local/python:3.11",
        "TORCH_INDEX_URL": "http://mirror.local/torch-cpu",
        "GPU_BASE_IMAGE": "local/python-torch-cpu",
        "REDIS_IMAGE": "local/redis:7",
        "PROMETHEUS_IMAGE": "local/prometheus",
        "GRAFANA_IMAGE": "local/grafana",
    }
    result = compose_config({**SECRETS, **local}, "--profile", "monitoring")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("api", "cpu-worker", "check-secrets", "gpu-worker"):
        assert services[name]["build"]["args"]["BASE_IMAGE"] == "local/python:3.11", name
    assert services["gpu-worker"]["build"]["args"]["TORCH_INDEX_URL"] == "http://mirror.local/torch-cpu"
    assert services["gpu-worker"]["build"]["args"]["GPU_BASE_IMAGE"] == "local/python-torch-cpu"
    assert (services["redis"]["image"], services["prometheus"]["image"], services["grafana"]["image"]) == (
        "local/redis:7",
        "local/prometheus",
        "local/grafana",
    )
    defaults = yaml.safe_load(compose_config(SECRETS, "--profile", "monitoring").stdout)["services"]
    assert (
        defaults["redis"]["image"] == "redis:7" and defaults["api"]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"
    )
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert dockerfile.index("ARG BASE_IMAGE=python:3.11-slim") < dockerfile.index("FROM ${BASE_IMAGE} AS app")
    # Without GPU_BASE_IMAGE the GPU worker starts from BASE_IMAGE and installs PyPI's (CUDA) torch.
    assert defaults["gpu-worker"]["build"]["args"]["GPU_BASE_IMAGE"] == ""
    assert "FROM ${GPU_BASE_IMAGE:-${BASE_IMAGE}} AS gpu-worker" in dockerfile


def test_every_shell_wrapped_service_execs_its_process_so_a_stop_reaches_it(compose):
    """`sh -c "..."` as a container's first process ignores SIGTERM: without exec a stop waits 10 s and kills
    (Redis then loses its last second of writes, a CPU worker its warm shutdown). The compose test checks a
    restarted Redis shut down cleanly; this keeps the commands right for every service."""
    wrapped = {
        name: service["command"]
        for name, service in compose["services"].items()
        if isinstance(service.get("command"), list) and service["command"][:2] == ["sh", "-c"]
    }
    assert {"redis", "cpu-worker"} <= set(wrapped)
    for name, command in wrapped.items():
        assert command[2].startswith("exec "), (name, command[2])
        assert "|" not in command[2], (name, "a pipeline runs its last command in a subshell: exec would not help")
    assert compose["services"]["redis"]["user"] == "redis"


def test_the_ha_file_puts_every_process_behind_the_sentinels_and_keeps_the_password_off_command_lines():
    """docker-compose.ha.yml laid over the main file: two replicas and three Sentinels (quorum 2), and every
    process of the service (API, CPU and callback workers, GPU worker, Flower) given the Sentinels."""
    result = compose_config(SECRETS, "-f", "docker-compose.yml", "-f", "docker-compose.ha.yml")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    sentinels = [name for name in services if name.startswith("sentinel-")]
    assert len(sentinels) == 3
    for name in sentinels:
        command = " ".join(services[name]["command"])
        assert "sentinel monitor imgserve redis 6379 2" in command and "--sentinel" in command
    for name in ("redis-replica-1", "redis-replica-2"):
        assert "--replicaof redis 6379" in " ".join(services[name]["command"])
    for name in ("api", "cpu-worker", "callback-worker", "gpu-worker", "flower"):
        env = services[name]["environment"]
        assert env["IMGSERVE_REDIS__SENTINELS"] == "[sentinel-1:26379, sentinel-2:26379, sentinel-3:26379]"
    for name, service in services.items():
        assert SECRETS["REDIS_PASSWORD"] not in " ".join(service.get("command") or []), name


@pytest.mark.parametrize(
    ("credentials", "says"),
    [
        (None, "FLOWER_BASIC_AUTH is not set"),
        ("admin:", "FLOWER_BASIC_AUTH's password for admin is empty"),  # .env.example's, copied as it is
        ("a-user-name-long-enough:", "FLOWER_BASIC_AUTH's password for a-user-name-long-enough is empty"),
        ("admin:change-me-to-something", "FLOWER_BASIC_AUTH's password for admin is a placeholder"),
        ("admin:hunter2", "FLOWER_BASIC_AUTH's password for admin is shorter than 16 characters"),
    ],
)
def test_flower_itself_refuses_to_start_without_a_usable_password(credentials, says):
    """Issue 53: a copied .env.example (`FLOWER_BASIC_AUTH=admin:`) opened Flower to `admin` with an empty password.
    Flower's own process refuses it, whoever starts it (make run, compose, by hand)."""
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    if credentials is not None:
        env["FLOWER_BASIC_AUTH"] = credentials
    done = subprocess.run(
        [sys.executable, "-c", "import tasks.flower"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stderr.startswith(f"flower: refusing to start: {says}"), done.stderr


def test_a_copied_env_example_is_refused_by_the_secrets_check_flower_included():
    """`cp .env.example .env` then `docker compose up`: check-secrets stops the stack, naming Flower's empty
    password among the rest, before Flower could start with it."""
    from contract.settings.check_secrets import problems
    from tools.procfile import parse_env

    copied = parse_env((REPO_ROOT / ".env.example").read_text())
    found = problems(
        ["REDIS_PASSWORD", "FLOWER_BASIC_AUTH", "GRAFANA_ADMIN_PASSWORD", "IMGSERVE_CALLBACK_SECRET?"], copied
    )
    assert "FLOWER_BASIC_AUTH's password for admin is empty" in found
    assert "REDIS_PASSWORD is not set" in found and "GRAFANA_ADMIN_PASSWORD is not set" in found


def _redis_settings() -> list[tuple[str, str]]:
    """configs/redis.conf's settings, as (name, value)."""
    lines = (REPO_ROOT / "configs" / "redis.conf").read_text().splitlines()
    return [tuple(line.split(None, 1)) for line in lines if line.strip() and not line.startswith("#")]  # type: ignore[misc]


def test_every_control_plane_redis_runs_with_configs_redis_conf(redis_client):
    """configs/redis.conf is the one list of the control plane's settings beyond Redis's defaults: make run,
    tools/redis_ha.py and the tests' servers (this test's answers with them) start redis-server with its settings,
    and compose's Redis commands and several-hosts.md's command line carry each of them."""
    settings = _redis_settings()
    assert ("hash-max-listpack-entries", "0") in settings
    for name, value in settings:
        assert redis_client.config_get(name) == {name: value}
    assert redis_config_args(REPO_ROOT) == [arg for name, value in settings for arg in (f"--{name}", value)]
    # make run and redis_ha pass the file's settings as options (test_make_run_private and test_failover read them
    # back from their servers), never the file itself: CONFIG REWRITE would rewrite it
    assert "configs/redis.conf" in (REPO_ROOT / "scripts" / "run-local").read_text()
    assert "*AS_CONFIGURED," in (REPO_ROOT / "tools" / "redis_ha.py").read_text()
    commands = [
        line
        for name in ("docker-compose.yml", "docker-compose.ha.yml", "docker-compose.cells.yml")
        for line in (REPO_ROOT / name).read_text().splitlines()
        if "exec redis-server -" in line and "allkeys-lru" not in line  # the cache's own Redis is no control plane
    ]
    commands.append(kubernetes_cells.REDIS_COMMAND)
    several_hosts = (REPO_ROOT / "docs" / "several-hosts.md").read_text()
    documented = several_hosts[several_hosts.index("runuser -u redis -- redis-server") :].split("\n```", 1)[0]
    assert len(commands) == 6  # the main file's Redis; the HA file's primary and two replicas; each cell's b; k8s's
    for command in (*commands, documented):
        for name, value in settings:
            assert f"--{name} {value}" in command, (name, command)


def test_compose_runs_the_result_cache_on_a_redis_of_its_own_under_a_profile(tmp_path):
    """--profile cache adds cache-redis; .env's IMGSERVE_CACHE__REDIS_URL points every API and GPU worker at it,
    both cells' with the cells overlay (one cache for the tier). Its command, run here as compose would run it: the
    password from stdin, allkeys-lru under its maxmemory, nothing written to disk."""
    url = f"redis://:{SECRETS['REDIS_PASSWORD']}@cache-redis:6379/0"
    cache = {**SECRETS, "IMGSERVE_CACHE__REDIS_URL": url, "CACHE_REDIS_MAXMEMORY": "2mb"}
    result = compose_config(cache, "-f", "docker-compose.yml", "-f", "docker-compose.cells.yml", "--profile", "cache")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("api", "gpu-worker", "gpu-worker-b"):
        assert services[name]["environment"]["IMGSERVE_CACHE__REDIS_URL"] == url, name
    redis_cache = services["cache-redis"]
    assert redis_cache["profiles"] == ["cache"] and "ports" not in redis_cache and redis_cache["user"] == "redis"
    plain = yaml.safe_load(compose_config(SECRETS).stdout)["services"]
    assert plain["api"]["environment"]["IMGSERVE_CACHE__REDIS_URL"] == ""  # unset: the cache on the control plane
    assert (
        "IMGSERVE_CACHE__REDIS_URL=redis://:<REDIS_PASSWORD>@cache-redis:6379/0"
        in (REPO_ROOT / ".env.example").read_text()
    )

    port = free_port()
    shell = redis_cache["command"][2].replace("$$", "$").replace("redis-server -", f"redis-server - --port {port}", 1)
    server = subprocess.Popen(
        ["sh", "-c", shell], cwd=tmp_path, env={**os.environ, **redis_cache["environment"]}, stdout=subprocess.DEVNULL
    )
    try:
        client = redis.Redis(port=port, password=SECRETS["REDIS_PASSWORD"])
        wait_until(lambda: _answers(client), 10, what="the cache Redis to answer")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("save") == {"save": ""} and client.config_get("appendonly") == {"appendonly": "no"}
        for i in range(100):  # 6.4 MB into 2 MB: evicted, never refused
            client.set(f"entry-{i}", b"x" * 64_000)
        assert 0 < client.dbsize() < 100
    finally:
        server.terminate()
        server.wait(10)
    assert not list(tmp_path.iterdir())  # nothing kept on disk


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
