"""deploy/k8s: every manifest parses and has the structure the design asks for, every HF_* setting a
container is given is one its service reads (no drift between settings and manifests), and kustomize renders
both overlays (kubectl's built-in kustomize, offline, where kubectl is installed) into objects that are valid
against the Kubernetes OpenAPI schemas of one fixed version (kubernetes-validate's bundled schemas, offline)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# The oldest Kubernetes the manifests promise to apply to; strict: a field the schema does not know fails too.
K8S_VERSION = "1.31.0"
SETTINGS = {"gpu_manager": "GpuManagerSettings", "agent": "AgentSettings", "controller": "ControllerSettings",
            "dc_manager": "DcManagerSettings", "router": "RouterSettings"}


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for f in sorted((K8S / "base").glob("*.yaml")):
        for d in docs(f):
            if d["kind"] != "Kustomization":
                out[(d["kind"], d["metadata"]["name"])] = d
    return out


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list(obj["spec"]["template"]["spec"]["containers"])


def service_of(c: dict[str, Any]) -> str | None:
    cmd = c.get("command") or []
    return next((a.removeprefix("services.") for a in cmd if a.startswith("services.")), None)


def settings_fields(service: str) -> set[str]:
    cls = getattr(importlib.import_module(f"services.{service}.settings"), SETTINGS[service])
    return {f"HF_{name.upper()}" for name in cls.model_fields}


def test_every_manifest_parses_and_every_kustomization_names_files_that_exist() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        for d in docs(f):
            assert d.get("apiVersion") and d.get("kind"), f
            if d["kind"] == "Kustomization":
                for res in d.get("resources", []):
                    assert (f.parent / res).exists(), f"{f}: {res} is missing"
            else:
                assert d["metadata"].get("name"), f


def test_the_node_daemonset_has_what_pidfds_peercred_and_gpus_need() -> None:
    ds = base()[("DaemonSet", "holdfast-node")]
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state["hostPath"]["path"]
    by_service = {service_of(c): c for c in pod["containers"]}
    assert set(by_service) == {"gpu_manager", "agent"}
    for c in by_service.values():
        env = {e["name"]: e for e in c["env"]}
        mount = next(m for m in c["volumeMounts"] if m["name"] == "state")
        assert env["HF_STATE_DIR"]["value"] == mount["mountPath"]
        assert env["HF_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"] and "add" not in c["securityContext"]["capabilities"]
    assert by_service["gpu_manager"]["resources"]["limits"]["nvidia.com/gpu"] >= 1


def test_the_cluster_side_is_replicated_probed_and_guarded() -> None:
    objs = base()
    for name, replicas in (("controller", 2), ("dc-manager", 2), ("router", 2)):
        dep = objs[("Deployment", name)]
        assert dep["spec"]["replicas"] >= replicas
        assert ("PodDisruptionBudget", name) in objs
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] in {n for k, n in objs if k == "ServiceAccount"}
    ctl = containers(objs[("Deployment", "controller")])[0]
    assert (ctl["livenessProbe"]["httpGet"]["path"], ctl["readinessProbe"]["httpGet"]["path"]) == ("/healthz", "/readyz")
    assert containers(objs[("Deployment", "router")])[0]["readinessProbe"]["httpGet"]["path"] == "/healthz"
    for name in ("etcd", "nats"):
        assert objs[("StatefulSet", name)]["spec"]["replicas"] == 3 and ("PodDisruptionBudget", name) in objs
    config = objs[("ConfigMap", "holdfast-config")]["data"]
    assert int(config["HF_STREAM_REPLICAS"]) == objs[("StatefulSet", "nats")]["spec"]["replicas"]
    assert all(f"nats-{i}.nats" in config["HF_NATS_URL"] for i in range(3))
    assert ("NetworkPolicy", "infra-from-holdfast") in objs


def test_every_setting_a_manifest_passes_is_one_its_service_reads() -> None:
    objs = base()
    config = set(objs[("ConfigMap", "holdfast-config")]["data"])
    seen = set()
    for (kind, _), obj in objs.items():
        if kind not in ("Deployment", "DaemonSet"):
            continue
        for c in containers(obj):
            service = service_of(c)
            if service is None:
                continue
            seen.add(service)
            given = {e["name"] for e in c.get("env", []) if e["name"].startswith("HF_")}
            if any(src.get("configMapRef", {}).get("name") == "holdfast-config" for src in c.get("envFrom", [])):
                given |= config
            unread = given - settings_fields(service)
            assert not unread, f"{service} is given settings it does not read: {sorted(unread)}"
    assert seen == set(SETTINGS)


def render(overlay: str) -> list[dict[str, Any]]:
    r = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def schema_errors(obj: dict[str, Any]) -> str | None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{obj['kind']}/{obj['metadata'].get('name')}: {e.message} at {'.'.join(map(str, e.path))}"
    return None


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl not installed (its kustomize renders offline)")


@needs_kubectl
@pytest.mark.parametrize("overlay", ["dev", "production"])
def test_kustomize_renders_each_overlay(overlay: str) -> None:
    rendered = render(overlay)
    assert all(d["metadata"].get("namespace") == "holdfast" for d in rendered if d["kind"] != "Namespace")
    ds = next(d for d in rendered if d["kind"] == "DaemonSet")
    backend = next(e for e in containers(ds)[0]["env"] if e["name"] == "HF_BACKEND")["value"]
    assert backend == ("host" if overlay == "dev" else "cuda")


@needs_kubectl
@pytest.mark.parametrize("overlay", ["dev", "production"])
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(overlay: str) -> None:
    rendered = render(overlay)
    kinds = {d["kind"] for d in rendered}
    assert {"DaemonSet", "Deployment", "StatefulSet", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    errors = [e for e in map(schema_errors, rendered) if e]
    assert not errors, "\n".join(errors)


@needs_kubectl
def test_the_schema_check_catches_a_misspelt_field_and_a_wrong_type() -> None:
    ds = next(d for d in render("dev") if d["kind"] == "DaemonSet")
    assert schema_errors(ds) is None
    pod = ds["spec"]["template"]["spec"]
    pod["hostPid"] = pod.pop("hostPID")  # unknown field: kubectl apply would drop it and pidfds would break
    assert schema_errors(ds) is not None
    pod["hostPID"] = pod.pop("hostPid")
    ds["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "metrics"}]
    assert schema_errors(ds) is not None


def test_no_state_dir_is_the_root_of_an_empty_dir() -> None:
    """An emptyDir's root is 0777, and a state directory others may write in is refused at start
    (CommonSettings.ensure_state_dir): each service's state dir is a directory of its own inside it."""
    checked = 0
    for (kind, _), obj in base().items():
        if kind not in ("Deployment", "DaemonSet"):
            continue
        empty = {v["name"] for v in obj["spec"]["template"]["spec"].get("volumes", []) if "emptyDir" in v}
        for c in containers(obj):
            state = next((e["value"] for e in c.get("env", []) if e["name"] == "HF_STATE_DIR"), None)
            mounts = {m["mountPath"].rstrip("/") for m in c.get("volumeMounts", []) if m["name"] in empty}
            if state is not None:
                checked += 1
                assert state.rstrip("/") not in mounts, f"{obj['metadata']['name']}: HF_STATE_DIR {state} is an emptyDir"
    assert checked >= 3
