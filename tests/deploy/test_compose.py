"""The compose stack (deploy/compose/), offline: `docker-compose config` resolves it (anchors, profiles), and
PyYAML reads the result. No container is run here (no container engine on our machines)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from libs.common.events import EngineSpec
from services.agent.settings import AgentSettings
from tests.deploy.test_k8s import SETTINGS, settings_fields

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose"
NODE = ("gpu_manager", "agent")  # each node's pair; the GPU profile adds a second pair (suffix -gpu)

pytestmark = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """Every service, anchors merged; docker-compose 1.29's `config` lists every profile's services."""
    out = subprocess.run(["docker-compose", "-f", str(COMPOSE / "docker-compose.yml"), "config"], capture_output=True,
                         text=True, timeout=60, check=True, env={"PATH": "/usr/bin:/bin", "HF_ADMIN_TOKEN": ""})
    return yaml.safe_load(out.stdout)["services"]


def with_profile(services: dict[str, Any], profile: str | None) -> dict[str, Any]:
    """What `up` starts: the services with no profile, and those of `profile`."""
    return {n: s for n, s in services.items() if not s.get("profiles") or profile in s["profiles"]}


def mounts(svc: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's volumes (`source:target[:mode]` strings, or long form)."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        out[target] = source
    return out


def published(svc: dict[str, Any]) -> set[str]:
    """Container ports published on the host (`[ip:]host:container` strings, or long form)."""
    return {p.rsplit(":", 1)[-1] if isinstance(p, str) else str(p["target"]) for p in svc.get("ports", [])}


def service_of(svc: dict[str, Any]) -> str | None:
    """The Holdfast service a container runs (`holdfast gpu-manager` -> gpu_manager), or None."""
    cmd = svc.get("command") or []
    if len(cmd) >= 2 and cmd[0] == "holdfast":
        return cmd[1].replace("-", "_")
    return None


@pytest.fixture(scope="module")
def cpu(resolved: dict[str, Any]) -> dict[str, Any]:
    return with_profile(resolved, None)


@pytest.fixture(scope="module")
def gpu(resolved: dict[str, Any]) -> dict[str, Any]:
    return with_profile(resolved, "gpu")


def test_the_default_stack_has_every_part_and_no_gpu(cpu: dict[str, Any]) -> None:
    assert set(SETTINGS) <= {service_of(s) for s in cpu.values()}
    assert {"nats", "etcd", "credentials", "etcd-auth", "weights"} <= set(cpu)
    assert not [n for n, s in cpu.items() if "deploy" in s], "a GPU reservation outside the gpu profile"


def test_the_gpu_profile_adds_a_node_with_a_device_reservation(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    added = set(gpu) - set(cpu)
    assert added == {f"{n}-gpu" for n in NODE}
    for name in added:
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert gpu[name]["environment"]["HF_NODE"] == "gpu-node-1"
    assert gpu["gpu_manager-gpu"]["environment"]["HF_BACKEND"] == "cuda"
    # its own state dir: two managers never share a socket or a lease table
    assert mounts(gpu["gpu_manager-gpu"])["/run/holdfast"] == mounts(gpu["agent-gpu"])["/run/holdfast"] == \
        "holdfast-run-gpu"
    # the credentials are minted, and etcd's roles made, for both nodes
    for one_shot in ("credentials", "etcd-auth"):
        assert gpu[one_shot]["command"].count("--node") == 2 and "gpu-node-1" in gpu[one_shot]["command"]


def test_every_long_running_part_has_a_health_check_and_waits_for_what_it_needs(gpu: dict[str, Any]) -> None:
    one_shots = {n for n, s in gpu.items() if s.get("restart") == "on-failure"}
    assert one_shots == {"credentials", "weights", "etcd-auth"}
    unprobed = {n for n, s in gpu.items() if "healthcheck" not in s} - one_shots
    assert unprobed == {"dc_manager"}  # no port: a crash restarts it
    for name, svc in gpu.items():
        for dep, how in svc.get("depends_on", {}).items():
            if how["condition"] == "service_healthy":
                assert "healthcheck" in gpu[dep], f"{name} waits for {dep}, which has no health check"
            if how["condition"] == "service_completed_successfully":
                assert dep in one_shots, f"{name} waits for {dep} to finish, but it runs forever"
    assert gpu["router"]["depends_on"]["controller"]["condition"] == "service_healthy"
    assert gpu["agent"]["depends_on"]["gpu_manager"]["condition"] == "service_healthy"


def test_every_setting_a_container_passes_is_one_its_service_reads(gpu: dict[str, Any]) -> None:
    seen = set()
    for name, svc in gpu.items():
        service = service_of(svc)
        if service is None:
            continue
        seen.add(service)
        unread = {k for k in svc.get("environment", {}) if k.startswith("HF_")} - settings_fields(service)
        assert not unread, f"{name} ({service}) is given settings it does not read: {sorted(unread)}"
    assert seen == set(SETTINGS)


@pytest.mark.parametrize("agent", ["agent", "agent-gpu"])
def test_each_agent_runs_a_reference_engine_and_standby_the_router_can_reach(gpu: dict[str, Any], agent: str) -> None:
    svc = gpu[agent]
    settings = AgentSettings(engines=json.loads(svc["environment"]["HF_ENGINES"]))
    [spec] = settings.engines
    assert isinstance(spec, EngineSpec) and (spec.replicas, spec.standbys) == (1, 1)
    assert spec.command[:4] == ["python", "-m", "engines.reference", "serve"]
    # the engine advertises the agent container's name, which the router resolves on the compose network
    assert spec.env["HF_ENGINE_HOST"] == svc["hostname"]
    # its weights file is the one the `weights` one-shot writes, in a volume both mount
    weights = spec.command[spec.command.index("--weights") + 1]
    assert weights in " ".join(gpu["weights"]["command"])
    folder = str(Path(weights).parent)
    assert mounts(svc)[folder] == mounts(gpu["weights"])[folder] == "models"
    assert svc["build"]["target"] == "engine" and svc["pid"] == "host"


def test_the_engine_image_has_torch_and_the_default_is_the_cpu_build() -> None:
    text = (COMPOSE / "Dockerfile").read_text()
    stages = [line.split()[-1] for line in text.splitlines() if line.startswith("FROM ")]
    assert stages == ["services", "engine"]
    engine = text[text.index("AS engine"):]
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in engine
    assert '--index-url "$TORCH_INDEX" "torch' in engine


def test_metrics_are_served_in_the_network_only(gpu: dict[str, Any]) -> None:
    for name in ("gpu_manager", "agent", "router"):
        env = gpu[name]["environment"]
        assert env["HF_METRICS_HOST"] == "0.0.0.0" and int(env["HF_METRICS_PORT"]) > 0
        assert env["HF_METRICS_PORT"] not in published(gpu[name])
