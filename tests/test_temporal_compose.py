"""The production compose file, checked without a Docker engine.

``docker-compose config`` (Debian's docker-compose, installed by scripts/ensure-services.sh)
must accept the file; then the resolved configuration is checked against Koi's settings:
every KOI_* variable a service sets is a setting of koi/config.py, the addresses point at
the services that exist, the ports are the ones the settings default to, images are pinned.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from koi.config import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "infra" / "Dockerfile"
KOI_SERVICES = ("koi-migrate", "koi-worker", "koi-planner", "koi-cluster", "koi-cli")


@pytest.fixture(scope="module")
def config() -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed; scripts/ensure-services.sh installs it (apt-get install docker-compose)")
    out = subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _port(mapping: str | dict) -> tuple[int, int]:
    """(published, target) from the short ("8233:8080") or the long syntax."""
    if isinstance(mapping, dict):
        return int(mapping["published"]), int(mapping["target"])
    host, _, container = str(mapping).rpartition(":")
    return int(host), int(container)


def test_compose_config_accepts_the_file(config):
    services = config["services"]
    assert {"postgresql", "temporal", "temporal-ui", "temporal-setup", *KOI_SERVICES} <= set(services)


def test_images_are_pinned(config):
    for name, svc in config["services"].items():
        image = svc.get("image")
        assert image, f"{name} has no image"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: image {image!r} is not pinned"
    assert config["services"]["temporal"]["image"].startswith("temporalio/auto-setup:")
    assert config["services"]["postgresql"]["image"].startswith("postgres:")


def test_koi_services_read_only_known_settings(config):
    fields = {f"KOI_{k.upper()}" for k in Settings.model_fields}
    required = {"KOI_DATABASE_URL", "KOI_TEMPORAL_ADDRESS", "KOI_TICK_TASK_QUEUE", "KOI_PLAN_TASK_QUEUE", "KOI_CLUSTER_ID"}
    for name in KOI_SERVICES:
        svc = config["services"][name]
        env = svc.get("environment", {})
        koi = {k for k in env if k.startswith("KOI_")}
        assert koi <= fields, f"{name} sets unknown settings: {sorted(koi - fields)}"
        assert required <= koi, f"{name} misses {sorted(required - koi)}"
        assert svc["build"]["dockerfile"] == "infra/Dockerfile"
        # the values parse as the settings (types, ranges)
        Settings(**{k.removeprefix("KOI_").lower(): v for k, v in env.items()})


def test_addresses_and_ports_match_the_services_and_the_settings(config):
    services = config["services"]
    defaults = Settings(_env_file=None)
    _, default_port = defaults.temporal_address.rsplit(":", 1)
    # Temporal's frontend and the UI are published on the ports the settings default to
    temporal_ports = [_port(p) for p in services["temporal"]["ports"]]
    assert (int(default_port), 7233) in temporal_ports
    ui_ports = [_port(p) for p in services["temporal-ui"]["ports"]]
    assert ui_ports and ui_ports[0][0] == defaults.temporal_ui_port
    assert services["temporal-ui"]["environment"]["TEMPORAL_ADDRESS"] == "temporal:7233"
    pg = services["postgresql"]["environment"]
    temporal = services["temporal"]["environment"]
    assert temporal["DB"] == "postgres12" and temporal["POSTGRES_SEEDS"] == "postgresql"
    assert temporal["POSTGRES_USER"] == pg["POSTGRES_USER"] and temporal["POSTGRES_PWD"] == pg["POSTGRES_PASSWORD"]
    for name in KOI_SERVICES:
        env = services[name]["environment"]
        host, port = env["KOI_TEMPORAL_ADDRESS"].split(":")
        assert host in services and int(port) == 7233, f"{name}: {env['KOI_TEMPORAL_ADDRESS']}"
        url = urlsplit(env["KOI_DATABASE_URL"])
        assert url.scheme == "postgresql+psycopg" and url.hostname in services and (url.port or 5432) == 5432
        assert url.path.lstrip("/") == pg["POSTGRES_DB"]
        assert url.username == pg["POSTGRES_USER"] and url.password == pg["POSTGRES_PASSWORD"]
        assert env["KOI_TICK_TASK_QUEUE"] == defaults.tick_task_queue
        assert env["KOI_PLAN_TASK_QUEUE"] == defaults.plan_task_queue


def test_workers_wait_for_the_schema_and_the_search_attributes(config):
    s = config["services"]
    for name in ("koi-worker", "koi-planner"):
        deps = s[name]["depends_on"]
        assert deps["koi-migrate"]["condition"] == "service_completed_successfully"
        assert deps["temporal-setup"]["condition"] == "service_completed_successfully"
    assert s["koi-migrate"]["command"] == ["db", "upgrade"]
    assert s["koi-worker"]["command"][:1] == ["worker"] and "ticks" in s["koi-worker"]["command"]
    assert "planning" in s["koi-planner"]["command"]
    assert "KoiOutcome" in " ".join(s["temporal-setup"]["command"])


def test_the_commands_the_services_run_exist():
    from typer.main import get_command

    from koi.cli import app

    cli = get_command(app)
    for cmd in (["db", "upgrade"], ["worker"], ["cluster", "start"], ["status"]):
        node = cli
        for part in cmd:
            node = node.commands[part]  # type: ignore[attr-defined]


def test_dockerfile_builds_the_koi_image():
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    base = next(ln for ln in lines if ln.startswith("FROM "))
    assert base.startswith("FROM python:3.11") and ":" in base
    for pkg in ("koi", "workflows", "activities", "workers", "infra"):
        assert any(ln.startswith(f"COPY {pkg} ") for ln in lines), pkg
    assert 'ENTRYPOINT ["koi"]' in lines and any(ln.startswith("USER ") for ln in lines)
