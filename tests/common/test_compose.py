"""deploy/compose is validated by docker-compose itself (no Docker engine runs here)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml  # type: ignore[import-untyped]

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "docker-compose.yml"


def test_compose_file_is_valid_for_docker_compose() -> None:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is installed by `make setup`"
    r = subprocess.run([exe, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_compose_runs_every_service_of_the_local_stack() -> None:
    from devstack.stack import SERVICES

    doc = yaml.safe_load(COMPOSE.read_text())
    assert {"nats", "etcd", *SERVICES} <= set(doc["services"])
    assert doc["services"]["nats"]["image"].startswith("nats:")
    assert "etcd" in doc["services"]["etcd"]["image"]
