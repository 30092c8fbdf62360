"""The alerting rules that ship (monitoring/alerts/): valid for Prometheus, and each one fired once by the condition it
names (promtool's unit tests, monitoring/alerts/imgserve.rules.test.yml), with a quiet neighbour beside several."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.support import REPO_ROOT

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
