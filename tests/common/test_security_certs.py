"""The credentials' certificates on file: rotation's writes (atomic, 0600, what it keeps), its refusals, `holdfast
certs status`, and a service refusing to start on an expired certificate (libs/common/security/rotation.py,
certs.py). The servers' side of rotation is tests/common/test_security_rotation.py."""

from __future__ import annotations

import datetime as dt
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from typer.testing import CliRunner

from holdfast.main import app
from libs.common.security import Credentials, CredentialsError, GrpcTls, identities, mint
from libs.common.security.certs import CertInfo, CertState, issued_by, read_pem, state_of
from libs.common.security.pki import SERVER, issue, load_ca, write_private
from libs.common.security.rotation import RotationRefused, retire_ca, rotate_ca, rotate_certificates, survey


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    return mint(tmp_path / "credentials", identities(["node-1"]), server_names=("nats",))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_rotation_writes_new_keys_atomically_private_and_keeps_nkeys_and_server_names(creds: Path) -> None:
    before = _files(creds)
    rotate_ca(creds, overlap_days=1)
    rotate_certificates(creds)
    after = _files(creds)
    assert set(after) == set(before) | {"ca-overlap.json"}  # no temporary file left behind
    assert all(stat.S_IMODE((creds / n).stat().st_mode) == 0o600 for n in after)
    keys = [n for n in before if n.endswith(".key")]
    assert keys and all(after[n] != before[n] for n in keys)  # every key new, the CA's too
    assert all(after[n] == before[n] for n in before if n.endswith(".nk"))  # NATS identities unchanged
    server = x509.load_pem_x509_certificate(after[f"{SERVER}.pem"])
    assert "nats" in server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    ca, _ = load_ca(creds)
    bundle = read_pem(creds / "ca.pem")
    assert bundle[0] == ca and len(bundle) == 2  # the current CA first, the previous one trusted too
    assert all(issued_by(read_pem(creds / n)[0], ca) for n in after if n.endswith(".pem") and n != "ca.pem")


def test_a_ca_is_retired_only_after_its_overlap_and_once_no_certificate_needs_it(creds: Path) -> None:
    ov = rotate_ca(creds, overlap_days=2)
    with pytest.raises(RotationRefused):
        rotate_ca(creds)  # one rotation at a time: at most two CAs in the bundle
    later = ov.retire_after + dt.timedelta(seconds=1)
    with pytest.raises(RotationRefused, match="trusted until"):
        retire_ca(creds, now=ov.retire_after - dt.timedelta(seconds=1))
    with pytest.raises(RotationRefused, match="still signed by the previous CA"):
        retire_ca(creds, now=later)  # the leaves are the previous CA's yet: retiring it would lock them out
    rotate_certificates(creds)
    assert len(retire_ca(creds, now=later)) == 1
    assert len(read_pem(creds / "ca.pem")) == 1 and not (creds / "ca-overlap.json").exists()


def test_a_certificates_state_says_the_worst_of_its_dates_and_its_issuer(creds: Path) -> None:
    bundle = read_pem(creds / "ca.pem")
    router = CertInfo.of("router.pem", read_pem(creds / "router.pem")[0], bundle)
    now = dt.datetime.now(dt.UTC)
    assert state_of(router, now) is CertState.OK
    assert state_of(router, router.not_after - dt.timedelta(days=3)) is CertState.EXPIRING
    assert state_of(router, router.not_after) is CertState.EXPIRED
    assert state_of(router, router.not_before - dt.timedelta(seconds=1)) is CertState.NOT_YET_VALID
    stranger = CertInfo.of("router.pem", read_pem(creds / "router.pem")[0], [])
    assert state_of(stranger, now) is CertState.UNTRUSTED


def _expire(d: Path, identity: str) -> None:
    issue(d, identity, load_ca(d), server=False, days=-0.001)  # valid until 86 s ago


def test_certs_status_lists_days_left_and_fails_on_an_expired_or_untrusted_certificate(creds: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["certs", "status", "--dir", str(creds)], env={"COLUMNS": "200"})
    assert ok.exit_code == 0, ok.output
    assert "router" in ok.output and "365.0" in ok.output
    _expire(creds, "router")
    assert {r.role: r.state for r in survey(creds)}["router"] is CertState.EXPIRED
    failed = runner.invoke(app, ["certs", "status", "--dir", str(creds)], env={"COLUMNS": "200"})
    assert failed.exit_code == 1 and "expired" in failed.output
    rotate_certificates(creds)
    ov = rotate_ca(creds, overlap_days=0)
    assert runner.invoke(app, ["certs", "retire-ca", "--dir", str(creds)]).exit_code == 2  # leaves still old
    retire_ca(creds, now=ov.retire_after, force=True)
    states = {r.role: r.state for r in survey(creds)}
    assert states["router"] is CertState.UNTRUSTED and states["current CA"] is CertState.OK


def test_a_service_with_an_expired_certificate_refuses_to_start_and_says_why(creds: Path, tmp_path: Path) -> None:
    _expire(creds, "router")
    env = {"HF_CREDENTIALS_DIR": str(creds), "HF_STATE_DIR": str(tmp_path / "state"),
           "HF_NATS_URL": "nats://127.0.0.1:1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "services.router"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "router.pem ('router') expired at" in r.stderr and "holdfast certs rotate" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_key_without_its_certificate_is_not_taken_up_and_the_last_good_tls_is_kept(creds: Path,
                                                                                      tmp_path: Path) -> None:
    admin = Credentials(creds, "admin")
    tls = GrpcTls(admin, check_every_s=0)
    good = tls.credentials()
    spare = tmp_path / "spare"
    spare.mkdir()
    issue(spare, "admin", load_ca(creds), server=False)
    write_private(creds / "admin.key", (spare / "admin.key").read_bytes())  # a rotation caught between renames
    with pytest.raises(CredentialsError, match="is not the key of"):
        admin.grpc_parts()
    with pytest.raises(ssl.SSLError):
        admin.client_tls()
    assert tls.renewed() is None and tls.credentials() is good  # kept, not a broken pair
    write_private(creds / "admin.pem", (spare / "admin.pem").read_bytes())  # the second rename lands
    assert tls.renewed() is not None
