"""The shipped deploy files, read once, and the local variants the tests run.

The tests never keep a second copy of a config or a command: they load the shipped one
(docker-compose.yml, deploy/...) and change only what must differ on this machine
(addresses, paths, waits), so a test passes only if the shipped file works.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "docker-compose.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERT_RULES = DEPLOY / "prometheus" / "alerts.yml"
ALERTMANAGER_CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)


def service_command(service: str) -> list[str]:
    """The container command of a compose service (exec form, a list of strings)."""
    command = compose()["services"][service]["command"]
    assert isinstance(command, list), f"{service}: write its command as a list (exec form)"
    return [str(a) for a in command]


def flag_value(argv: list[str], flag: str) -> str:
    """The value of `flag` in `argv` (`--f v` or `--f=v`); the last one wins, as in argparse."""
    values = [
        a.partition("=")[2] if "=" in a else argv[i + 1]
        for i, a in enumerate(argv)
        if a.partition("=")[0] == flag
    ]
    assert values, f"{flag} not in {argv}"
    return values[-1]


def compose_address(service: str) -> str:
    """'service:port' where the service listens inside the stack, from its command."""
    argv = service_command(service)
    if "--port" in argv:  # trainvitals commands
        return f"{service}:{flag_value(argv, '--port')}"
    return f"{service}:{flag_value(argv, '--web.listen-address').rpartition(':')[2]}"


def replace_flags(argv: list[str], values: dict[str, str]) -> list[str]:
    """`argv` with the value of each flag in `values` replaced (`--f v` or `--f=v` forms).

    A flag to replace that `argv` lacks is an error: a renamed flag must break the test,
    not silently drop the local override.
    """
    out, missing = list(argv), set(values)
    for i, arg in enumerate(out):
        flag, eq, _ = arg.partition("=")
        if flag in values:
            if eq:
                out[i] = f"{flag}={values[flag]}"
            else:
                out[i + 1] = values[flag]
            missing.discard(flag)
    assert not missing, f"flags {sorted(missing)} not in {argv}"
    return out


def binary(name: str) -> str:
    """Path of a server binary from the Debian packages; the test fails (not skips) without it."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else "")
    if not path:
        pytest.fail(
            f"{name} not found: install the Debian packages prometheus and "
            "prometheus-alertmanager (apt-get install prometheus prometheus-alertmanager); "
            "`make test` does this (scripts/install-system-deps.sh)"
        )
    return path


def prometheus_test_config(
    targets: dict[str, str], interval: str = "1s", token_file: Path | None = None
) -> dict[str, Any]:
    """The shipped prometheus.yml with local targets, 1 s intervals and absolute rule paths;
    the collector's token read from `token_file` (else the placeholder beside the config).

    `targets` maps each compose address in the config ("collector:8000") to a local one.
    Every target must be mapped, so a target added to the shipped file cannot go untested.
    """
    cfg = load_yaml(PROMETHEUS_CONFIG)
    cfg["global"].update(scrape_interval=interval, evaluation_interval=interval)
    cfg["rule_files"] = [str(PROMETHEUS_CONFIG.parent / f) for f in cfg["rule_files"]]
    for job in cfg["scrape_configs"]:  # the token file, as the rules: beside the config
        if "authorization" in job:
            auth = job["authorization"]
            auth["credentials_file"] = str(
                token_file or PROMETHEUS_CONFIG.parent / auth["credentials_file"]
            )
    static = [
        sc
        for section in (cfg["scrape_configs"], cfg["alerting"]["alertmanagers"])
        for job in section
        for sc in job["static_configs"]
    ]
    for sc in static:
        unmapped = set(sc["targets"]) - set(targets)
        assert not unmapped, f"no local address for {sorted(unmapped)}"
        sc["targets"] = [targets[t] for t in sc["targets"]]
    return cfg


def alertmanager_test_config(webhook_url: str) -> dict[str, Any]:
    """The shipped alertmanager.yml, every receiver a webhook to the test, waits shortened.

    The routing tree and inhibition rules stay as shipped: they are part of what is tested.
    """
    cfg = load_yaml(ALERTMANAGER_CONFIG)
    hook = [{"url": webhook_url, "send_resolved": False}]
    cfg["receivers"] = [{"name": r["name"], "webhook_configs": hook} for r in cfg["receivers"]]
    # group_wait 0: notify at once; repeat_interval long: one notification per alert.
    waits = {"group_wait": "0s", "group_interval": "1s", "repeat_interval": "1h"}
    routes = [cfg["route"]]
    while routes:
        route = routes.pop()
        route.update({k: v for k, v in waits.items() if k in route or route is cfg["route"]})
        routes.extend(route.get("routes", []))
    return cfg
