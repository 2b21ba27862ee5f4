"""The credentials directory: minted once, private, kept; a service without credentials says so and exits."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from cryptography import x509

from libs.common.security import identities, mint
from libs.common.security.policy import identity_for


def test_minted_credentials_are_private_and_kept_across_restarts(tmp_path: Path) -> None:
    d = mint(tmp_path / "creds", identities(["node-1"]), server_names=("nats",))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = sorted(d.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    before = {f.name: f.read_bytes() for f in files}
    mint(d, identities(["node-1", "node-2"]))  # a node more: the existing keys stay, the new ones are added
    after = {f.name: f.read_bytes() for f in d.iterdir()}
    assert {k: after[k] for k in before} == before and "agent.node-2.nk" in after
    san = x509.load_pem_x509_certificate(after["server.pem"]).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert "nats" in san.get_values_for_type(x509.DNSName)
    cn = x509.load_pem_x509_certificate(after["router.pem"]).subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    assert cn[0].value == "router"  # etcd's user name


def test_each_connection_picks_its_services_identity() -> None:
    assert identity_for("agent:node-7", "node-7") == "agent.node-7"
    assert identity_for("gpu_manager:x", "node-2") == "gpu_manager.node-2"
    assert identity_for("controller-api:c1", "node-1") == "controller"
    assert identity_for("dc_manager:dc-1", "dcm0") == "dc_manager"
    assert identity_for("bench", "node-1") == identity_for("test", "n") == "admin"


def test_a_service_without_credentials_says_so_and_exits_non_zero(tmp_path: Path) -> None:
    env = {"HF_CREDENTIALS_DIR": str(tmp_path / "none"), "HF_STATE_DIR": str(tmp_path / "state"),
           "HF_NATS_URL": "nats://127.0.0.1:1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "services.router"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "no credentials for 'router'" in r.stderr and "Traceback" not in r.stderr
