"""The alerting rules that ship (monitoring/alerts/): valid for Prometheus, and each one fired once by the condition it
names (promtool's unit tests, monitoring/alerts/imgserve.rules.test.yml), with a quiet neighbour beside several: 404s,
405s and 410s beside accepted work never make refused work (issue 69), nor does one queue exported by several GPU
workers make a backlog. The refusing-work rule also runs on the counters a live API exported."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from app import create_app
from contract.settings.config import load_settings
from tests.support import REPO_ROOT, ApiServer, RedisServer, jpeg

ALERTS = REPO_ROOT / "monitoring" / "alerts"
RULES, RULE_TESTS = ALERTS / "imgserve.rules.yml", ALERTS / "imgserve.rules.test.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: scripts/bootstrap --dev installs Debian's prometheus package, which has it"
    return found


def test_the_rules_pass_promtools_check():
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_rule_fires_in_a_unit_test_by_the_condition_it_names():
    done = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name], cwd=ALERTS, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rules = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    fired = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert rules == fired, f"rules without a test that fires them: {sorted(rules - fired)}"


def test_prometheus_loads_the_rules_that_ship_and_each_names_its_runbook():
    config = yaml.safe_load((REPO_ROOT / "monitoring" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts/*.rules.yml"]
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    assert "./monitoring/alerts:/etc/prometheus/alerts:ro" in compose["services"]["prometheus"]["volumes"]
    operations = (REPO_ROOT / "docs" / "operations.md").read_text()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            anchor = rule["annotations"]["runbook"].split("#", 1)[1]
            assert anchor in _anchors(operations), (rule["alert"], anchor)


def _anchors(markdown: str) -> set[str]:
    """The anchors MkDocs gives the page's headings (lower case, punctuation dropped, spaces to hyphens)."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            kept = "".join(ch for ch in title if ch.isalnum() or ch in " -_")
            anchors.add("-".join(kept.split()))
    return anchors


# The refusing-work rule against what a live API counts: a real API on a private Redis (no CPU worker, so a small
# backlog fills), real HTTP, its /metrics scraped before and after. The counters' growth between the two scrapes
# becomes a minute of promtool's input, repeated for half an hour, and the shipped rule is evaluated on it as it
# stands (its 5-minute rate and its 10 minutes of `for`).
LIVE_BACKLOG = 3
REFUSAL_COUNTERS = ("imgserve_api_requests_total", "imgserve_api_rejects_total")


@pytest.fixture(scope="module")
def refusing_api(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    config = tmp_path_factory.mktemp("alerts") / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "redis_url": redis_server.url.rsplit("/", 1)[0] + "/13",
                "namespace": "alerts",
                "cache": {"enabled": False},
                "backpressure": {"max_backlog": LIVE_BACKLOG},
            }
        )
    )
    server = ApiServer(create_app(load_settings(config)))
    yield server
    server.stop()


def test_reads_of_unknown_jobs_and_wrong_methods_beside_accepted_work_do_not_fire_refusing_work_but_refusals_do(
    refusing_api: ApiServer,
):
    session = requests.Session()
    before = _scrape(refusing_api)
    malformed = {"files": {"image": ("a.jpg", jpeg(32, 32))}, "data": {"conf": "2"}, "timeout": 30}  # conf in [0, 1]
    answers = [session.post(refusing_api.url + "/v1/jobs", **malformed) for _ in range(2)]
    for _ in range(LIVE_BACKLOG):
        accepted = session.post(refusing_api.url + "/v1/jobs", files={"image": ("a.jpg", jpeg(32, 32))}, timeout=30)
        assert accepted.status_code == 202, accepted.text
    answers += [session.get(f"{refusing_api.url}/v1/jobs/{uuid.uuid4().hex}", timeout=30) for _ in range(20)]
    answers += [session.get(refusing_api.url + "/v1/jobs", timeout=30) for _ in range(5)]
    answers += [session.put(f"{refusing_api.url}/v1/jobs/{uuid.uuid4().hex}", timeout=30) for _ in range(5)]
    assert sorted(answer.status_code for answer in answers) == [400] * 2 + [404] * 20 + [405] * 10
    quiet = _scrape(refusing_api)
    rejected: dict[str, float] = {}
    for (name, labels), grown in _growth(before, quiet).items():
        if name == "imgserve_api_rejects_total":
            rejected[dict(labels)["status"]] = rejected.get(dict(labels)["status"], 0.0) + grown
    assert {status: count for status, count in rejected.items() if count} == {"400": 2, "404": 20, "405": 10}
    _assert_promtool_says(before, quiet, fires=None)

    for _ in range(2):  # the backlog is full: refused work
        refused = session.post(refusing_api.url + "/v1/jobs", files={"image": ("a.jpg", jpeg(32, 32))}, timeout=30)
        assert refused.status_code == 429, refused.text
    # 2 refused of 7 submissions (3 accepted, 2 malformed, 2 refused)
    _assert_promtool_says(before, _scrape(refusing_api), fires=2 / (LIVE_BACKLOG + 4))


Sample = tuple[str, tuple[tuple[str, str], ...]]


def _scrape(api: ApiServer) -> dict[Sample, float]:
    """The API's refusal counters as Prometheus reads them from its /metrics."""
    page = requests.get(api.url + "/metrics", timeout=30)
    assert page.status_code == 200, page.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page.text)
        for sample in family.samples
        if sample.name in REFUSAL_COUNTERS
    }


def _growth(before: dict[Sample, float], after: dict[Sample, float]) -> dict[Sample, float]:
    return {sample: value - before.get(sample, 0.0) for sample, value in after.items()}


def _assert_promtool_says(before: dict[Sample, float], after: dict[Sample, float], fires: float | None) -> None:
    """promtool's verdict on the shipped rule when the traffic between the scrapes `before` and `after` comes every
    minute: no alert (`fires` None), or one whose summary names the share `fires` of submissions refused."""
    series = [
        {"series": _selector(name, labels), "values": f"{before.get((name, labels), 0.0):g}+{grown:g}x30"}
        for (name, labels), grown in _growth(before, after).items()
    ]
    expected = []
    if fires is not None:
        expected = [
            {
                "exp_labels": {"severity": "page"},
                "exp_annotations": {
                    "summary": f"{fires * 100:.4g}% of submissions refused",
                    "runbook": "docs/operations.md#p95-is-rising-what-to-decide",
                },
            }
        ]
    cases = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [{"eval_time": "20m", "alertname": "ImgserveRefusingWork", "exp_alerts": expected}],
            }
        ],
    }
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "live.test.yml"
        path.write_text(yaml.safe_dump(cases))
        done = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr + yaml.safe_dump(series)


def _selector(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    def quoted(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    return name + "{" + ",".join(f"{label}={quoted(value)}" for label, value in labels) + "}"
