"""docker-compose.yml and the Dockerfile, validated without a Docker engine.

What `docker compose up` would trip over is checked statically: the YAML, build contexts
and mounted files, ports against the commands that listen on them, the host names in the
Prometheus, Alertmanager and Grafana configs against the services, and the trainvitals
commands against the real argument parser. The collector, Prometheus and Alertmanager
commands are also the ones the end-to-end alerting test runs (servers.py).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest

from trainvitals.cli import build_parser
from trainvitals.dashboard.launch import dashboard_command
from trainvitals.trainer import config as train_config

from .stack import (
    COMPOSE_FILE,
    DEPLOY,
    PROMETHEUS_CONFIG,
    REPO,
    compose,
    compose_address,
    flag_value,
    load_yaml,
    service_command,
)

SERVICES = {"collector", "dashboard", "trainer", "prometheus", "alertmanager", "grafana"}
PROJECT_SERVICES = ("collector", "dashboard", "trainer")  # built from the Dockerfile
_PYCACHE = shutil.ignore_patterns("__pycache__")


def _service(name: str) -> dict:
    return compose()["services"][name]


def _mounts(name: str) -> dict[str, str]:
    """Container path -> host path (relative to the repo) of the service's bind mounts."""
    out = {}
    for spec in _service(name).get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith("."):
            out[target] = source
    return out


def _host_file(service: str, container_path: str):
    """The repo file that `container_path` is inside the service, through its bind mounts."""
    path = PurePosixPath(container_path)
    for target, source in _mounts(service).items():
        if path == PurePosixPath(target) or PurePosixPath(target) in path.parents:
            return (COMPOSE_FILE.parent / source / path.relative_to(target)).resolve()
    pytest.fail(f"{service}: {container_path} is not mounted from the repository")


def _copied() -> set[str]:
    """What the Dockerfile copies from the build context: `COPY src... dest` sources."""
    lines = (REPO / "Dockerfile").read_text().splitlines()
    return {src for line in lines if line.startswith("COPY ") for src in line.split()[1:-1]}


def _container_ports(name: str) -> set[int]:
    return {int(str(p).rsplit(":", 1)[1]) for p in _service(name).get("ports", [])}


def test_the_stack_has_every_service() -> None:
    assert set(compose()["services"]) == SERVICES


def test_build_contexts_and_mounted_files_exist() -> None:
    services = compose()["services"]
    declared_volumes = set(compose().get("volumes") or {})
    for name, svc in services.items():
        if "build" in svc:
            context = COMPOSE_FILE.parent / svc["build"]
            assert (context / "Dockerfile").is_file(), name
        else:
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", svc["image"]), f"{name}: pin a version"
        for spec in svc.get("volumes", []):
            source = spec.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_FILE.parent / source).exists(), f"{name}: {source} is missing"
            else:
                assert source in declared_volumes, f"{name}: volume {source} is not declared"


def test_the_dockerfile_copies_every_package_folder() -> None:
    """pyproject.toml maps folders to trainvitals.*; an image without one cannot import it."""
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = _copied()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders <= copied, f"not copied: {sorted(folders - copied)}"
    for source in copied:
        assert (REPO / source).exists(), source
    assert 'ENTRYPOINT ["trainvitals"]' in dockerfile  # commands in compose start at the job
    assert "trainvitals" in pyproject["project"]["scripts"]


@pytest.mark.slow
def test_the_copied_sources_build_the_package(tmp_path: Path) -> None:
    """`pip install .` in the image sees only what the Dockerfile copies, minus .dockerignore."""
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    context = tmp_path / "context"
    context.mkdir()
    for source in _copied():
        assert not any(fnmatch.fnmatch(source, p) for p in ignored), f"{source} is ignored"
        if (REPO / source).is_dir():
            shutil.copytree(REPO / source, context / source, ignore=_PYCACHE)
        else:
            shutil.copy(REPO / source, context / source)
    # The build backend pip would call, without pip's start-up cost.
    build = "from setuptools import build_meta as b; b.build_wheel('dist')"
    proc = subprocess.run(
        [sys.executable, "-c", build], cwd=context, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (context / "dist").glob("trainvitals-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("cli", "collector/main", "dashboard/app", "trainer/train", "hooks/monitor"):
        assert f"trainvitals/{module}.py" in names, module


def test_published_ports_are_the_ports_the_commands_listen_on() -> None:
    for name in ("collector", "dashboard", "prometheus", "alertmanager"):
        port = int(compose_address(name).rpartition(":")[2])
        assert _container_ports(name) == {port}, name
    assert _container_ports("grafana") == {3000}  # Grafana's default


def test_prometheus_scrapes_the_collector_and_alerts_the_alertmanager() -> None:
    cfg = load_yaml(PROMETHEUS_CONFIG)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    # The rules' `up{job="trainvitals"}` depends on this job name.
    targets = [t for sc in jobs["trainvitals"]["static_configs"] for t in sc["targets"]]
    assert targets == [compose_address("collector")]
    alertmanagers = [
        t
        for am in cfg["alerting"]["alertmanagers"]
        for sc in am["static_configs"]
        for t in sc["targets"]
    ]
    assert alertmanagers == [compose_address("alertmanager")]


def test_prometheus_and_alertmanager_read_the_shipped_configs() -> None:
    config = flag_value(service_command("prometheus"), "--config.file")
    assert _host_file("prometheus", config) == PROMETHEUS_CONFIG
    # Rule files resolve relative to the config file, inside the container as here.
    for rules in load_yaml(PROMETHEUS_CONFIG)["rule_files"]:
        in_container = PurePosixPath(config).parent / rules
        assert _host_file("prometheus", str(in_container)) == PROMETHEUS_CONFIG.parent / rules
    config = flag_value(service_command("alertmanager"), "--config.file")
    assert _host_file("alertmanager", config) == DEPLOY / "alertmanager" / "alertmanager.yml"


def test_grafana_reads_prometheus_and_the_provisioned_dashboard() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert _host_file("grafana", "/etc/grafana/provisioning") == provisioning
    datasources = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    (source,) = datasources
    assert urlsplit(source["url"]).netloc == compose_address("prometheus")
    (provider,) = load_yaml(provisioning / "dashboards" / "trainvitals.yml")["providers"]
    folder = _host_file("grafana", provider["options"]["path"])
    dashboards = sorted(folder.glob("*.json"))
    assert dashboards, f"no dashboard in {folder}"
    home = _service("grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _host_file("grafana", home).is_file()
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        uids = {
            t["datasource"]["uid"]
            for p in dashboard["panels"]
            for t in [p, *p.get("targets", [])]
            if "datasource" in t
        }
        assert uids == {source["uid"]}, path.name


def test_trainvitals_commands_parse_with_the_real_cli() -> None:
    parser = build_parser()
    collector = parser.parse_args(service_command("collector"))
    assert collector.command == "collector" and collector.host == "0.0.0.0"  # reachable
    store_dir = str(PurePosixPath(collector.store).parent)
    assert any(v.split(":")[1] == store_dir for v in _service("collector")["volumes"]), (
        "the store must live on a volume, or it is lost with the container"
    )

    dashboard = parser.parse_args(service_command("dashboard"))
    assert dashboard.command == "dashboard" and dashboard.host == "0.0.0.0"
    assert urlsplit(dashboard.collector).netloc == compose_address("collector")
    dashboard_command(dashboard.collector, port=dashboard.port, host=dashboard.host)  # validates

    trainer = parser.parse_args(service_command("trainer"))
    cfg = train_config.from_args(trainer)  # what `trainvitals train` checks before launching
    assert trainer.nproc == cfg.dp * cfg.tp == 4 and cfg.device in ("auto", "cpu")
    assert urlsplit(cfg.collector).netloc == compose_address("collector")


def test_services_that_need_the_collector_wait_for_it() -> None:
    for name in ("dashboard", "trainer"):
        depends = _service(name)["depends_on"]
        assert depends["collector"]["condition"] == "service_healthy", name
    assert "healthcheck" in _service("collector")
    for name in PROJECT_SERVICES:
        assert _service(name)["build"] == "." and _service(name)["image"] == "trainvitals:local"
