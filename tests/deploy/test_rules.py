"""The shipped Prometheus and Alertmanager configs, checked by the servers' own tools:
promtool (check config, check rules, the rule unit tests) and amtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from .stack import (
    ALERT_RULES,
    ALERTMANAGER_CONFIG,
    DEPLOY,
    PROMETHEUS_CONFIG,
    alertmanager_test_config,
    binary,
    load_yaml,
    prometheus_test_config,
)

RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yml"))
ALERTMANAGER_CONFIGS = [ALERTMANAGER_CONFIG, *sorted((DEPLOY / "alertmanager").glob("*/*.yml"))]


def _ok(*argv: str | Path) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _alerts() -> list[dict]:
    return [r for g in load_yaml(ALERT_RULES)["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.slow
def test_promtool_accepts_the_rules_and_the_config() -> None:
    _ok(binary("promtool"), "check", "rules", ALERT_RULES)
    out = _ok(binary("promtool"), "check", "config", PROMETHEUS_CONFIG)
    assert "SUCCESS" in out and "alerts.yml" in out  # the config really loads the rules


@pytest.mark.slow
@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_rule_unit_tests_pass(test_file: Path) -> None:
    _ok(binary("promtool"), "test", "rules", test_file)


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    firing, quiet = set(), set()
    for test_file in RULE_TESTS:
        for case in load_yaml(test_file)["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"


def test_every_alert_tells_the_person_on_call_what_and_what_to_do() -> None:
    for rule in _alerts():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        for field in ("summary", "description", "runbook"):
            assert rule["annotations"].get(field, "").strip(), f"{rule['alert']}: no {field}"


@pytest.mark.slow
@pytest.mark.parametrize("config", ALERTMANAGER_CONFIGS, ids=lambda p: p.name)
def test_amtool_accepts_the_alertmanager_configs(config: Path) -> None:
    _ok(binary("amtool"), "check-config", config)


# Where each severity the rules use ends up: (config, severity, receivers in order).
ROUTES = [
    ("alertmanager.yml", "critical", "critical"),
    ("alertmanager.yml", "warning", "warning"),
    ("examples/pagerduty.yml", "critical", "pagerduty,slack"),
    ("examples/pagerduty.yml", "warning", "slack"),
    ("examples/slack.yml", "critical", "slack"),
    ("examples/slack.yml", "warning", "slack"),
    ("examples/webhook.yml", "critical", "webhook"),
    ("examples/webhook.yml", "warning", "webhook"),
]


@pytest.mark.slow
@pytest.mark.parametrize("config, severity, receivers", ROUTES)
def test_alerts_are_routed_by_severity(config: str, severity: str, receivers: str) -> None:
    labels = ["alertname=TrainvitalsSDCSuspect", "run_id=r1", f"severity={severity}"]
    _ok(
        binary("amtool"),
        "config",
        "routes",
        "test",
        f"--config.file={DEPLOY / 'alertmanager' / config}",
        f"--verify.receivers={receivers}",
        *labels,
    )


def test_every_severity_of_the_rules_has_a_route() -> None:
    routed = {severity for config, severity, _ in ROUTES if config == "alertmanager.yml"}
    assert {a["labels"]["severity"] for a in _alerts()} <= routed


@pytest.mark.slow
def test_the_end_to_end_test_configs_are_valid_too(tmp_path: Path) -> None:
    """What the end-to-end test derives from the shipped files, checked the same way."""
    local = {
        "collector:8000": "127.0.0.1:1",
        "alertmanager:9093": "127.0.0.1:2",
        "localhost:9090": "127.0.0.1:3",
    }
    prom = tmp_path / "prometheus.yml"
    prom.write_text(yaml.safe_dump(prometheus_test_config(local)))
    _ok(binary("promtool"), "check", "config", prom)
    am = tmp_path / "alertmanager.yml"
    am.write_text(yaml.safe_dump(alertmanager_test_config("http://127.0.0.1:4/alerts")))
    _ok(binary("amtool"), "check-config", am)
