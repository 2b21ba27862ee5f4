"""The credentials directory: a dev CA, server and client certificates, NATS nkeys (all minted by the kept
libraries `cryptography` and `nkeys`; nothing home-made), and loading them for a connection.

Layout of `<dir>` (0700; every file 0600; production mounts the same names from a Kubernetes Secret):
    ca.pem                     the CA certificate every client and server trusts
    ca.key                     the CA key (dev only: lets `mint` add identities later; production omits it)
    server.pem, server.key     nats-server's and etcd's certificate (127.0.0.1, ::1, localhost, `server_names`)
    <identity>.pem, .key       a client certificate, CN = identity (etcd maps the CN to its user)
    <identity>.nk              the identity's NATS nkey seed (its public key goes in nats-server's config)
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from libs.common.errors import HoldfastError
from libs.common.security.policy import ROOT

VALID_DAYS = 365
SERVER = "server"


class CredentialsMissing(HoldfastError):
    code = "credentials_missing"


def _write_private(path: Path, data: bytes) -> None:
    """Create `path` 0600 from the start (never world-readable, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "holdfast"), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _load_ca(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not (d / "ca.pem").exists():
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(_name("holdfast dev CA")).issuer_name(_name("holdfast dev CA"))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        _write_private(d / "ca.key", _key_pem(key))
        _write_private(d / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    return cert, ca_key


def _issue(d: Path, cn: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], *, server: bool,
           names: tuple[str, ...] = ()) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca[0].subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    if server:
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")), *(x509.DNSName(n) for n in names)]
        # etcd also dials itself with this certificate: it is a client certificate too.
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    cert = b.sign(ca[1], hashes.SHA256())
    _write_private(d / f"{cn}.key", _key_pem(key))
    _write_private(d / f"{cn}.pem", cert.public_bytes(serialization.Encoding.PEM))


def mint(d: Path, identities: list[str], *, server_names: tuple[str, ...] = ()) -> Path:
    """Create what is missing in the credentials directory `d` (the CA, the server certificate, each identity's
    certificate and nkey, etcd's root certificate); what exists is kept, so a restarted stack keeps its keys.
    `server_names`: host names the servers are reached by besides loopback (compose: `nats`, `etcd`)."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    ca = _load_ca(d)
    if not (d / f"{SERVER}.pem").exists():
        _issue(d, SERVER, ca, server=True, names=server_names)
    for ident in [ROOT, *identities]:
        if not (d / f"{ident}.pem").exists():
            _issue(d, ident, ca, server=False)
        if ident != ROOT and not (d / f"{ident}.nk").exists():
            seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
            _write_private(d / f"{ident}.nk", seed)
    return d


def nkey_public(d: Path, identity: str) -> str:
    kp = nkeys.from_seed(bytearray((d / f"{identity}.nk").read_bytes().strip()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


@dataclass(frozen=True)
class Credentials:
    """One identity's files in a credentials directory (checked present by `load`)."""

    dir: Path
    identity: str

    @classmethod
    def load(cls, d: Path, identity: str, *, nats: bool = True) -> Credentials:
        creds = cls(d, identity)
        need = [creds.ca, creds.cert, creds.key] + ([creds.nkey_seed] if nats else [])
        missing = [p.name for p in need if not p.is_file()]
        if missing:
            raise CredentialsMissing(
                f"no credentials for {identity!r} in {d} (missing {', '.join(missing)}): run `holdfast up` once to "
                "create the dev ones, or mount them there (HF_CREDENTIALS_DIR); HF_INSECURE=1 connects without")
        return creds

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.dir / f"{self.identity}.pem"

    @property
    def key(self) -> Path:
        return self.dir / f"{self.identity}.key"

    @property
    def nkey_seed(self) -> Path:
        return self.dir / f"{self.identity}.nk"

    def client_tls(self) -> ssl.SSLContext:
        """Verifies the server against the CA (hostname included); presents this identity's certificate."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    def grpc_parts(self) -> tuple[bytes, bytes, bytes]:
        """(CA, key, certificate) as gRPC's ssl_channel_credentials wants them."""
        return self.ca.read_bytes(), self.key.read_bytes(), self.cert.read_bytes()
