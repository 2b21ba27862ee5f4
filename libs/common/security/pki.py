"""The credentials directory: a dev CA, server and client certificates, NATS nkeys (all minted by the kept
libraries `cryptography` and `nkeys`; nothing home-made), and loading them for a connection.

Layout of `<dir>` (0700; every file 0600; production mounts the same names from a Kubernetes Secret):
    ca.pem                     the trust bundle every client and server trusts: the current CA first, then a
                               previous one during a CA rotation's overlap (rotation.py)
    ca.key                     the current CA's key (dev only: lets `mint` add identities and `holdfast certs`
                               rotate them; production omits it)
    ca-overlap.json            during a CA rotation only: when the previous CA may be retired
    server.pem, server.key     nats-server's and etcd's certificate (127.0.0.1, ::1, localhost, `server_names`)
    <identity>.pem, .key       a client certificate, CN = identity (etcd maps the CN to its user)
    <identity>.nk              the identity's NATS nkey seed (its public key goes in nats-server's config)
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from libs.common.security.certs import CertInfo, CredentialsError, read_pem, refuse_if_expired
from libs.common.security.policy import ROOT

VALID_DAYS = 365
PAIR_READS, PAIR_RETRY_S = 5, 0.01  # a key and certificate read mid-rotation: read again, at most this often
SERVER = "server"


class CredentialsMissing(CredentialsError):
    code = "credentials_missing"


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` atomically with `data`, 0600 from the start (never world-readable, not even for a moment):
    a reader (nats-server on reload, etcd on each handshake, a client's reconnect) sees the old file or the new
    one, never a part. The temporary file is in the same directory (same filesystem: `rename` is atomic)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)



def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "holdfast"), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


CA = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def new_ca(days: float = VALID_DAYS) -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name("holdfast dev CA")).issuer_name(_name("holdfast dev CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def load_ca(d: Path) -> CA:
    """The current CA: `ca.key` and, of the trust bundle `ca.pem`, the certificate of that key."""
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    for cert in read_pem(d / "ca.pem"):
        if cert.public_key() == ca_key.public_key():
            return cert, ca_key
    raise CredentialsError(f"{d}/ca.key is the key of no CA in {d}/ca.pem")


def _load_ca(d: Path) -> CA:
    if not (d / "ca.pem").exists():
        cert, key = new_ca()
        write_private(d / "ca.key", _key_pem(key))
        write_private(d / "ca.pem", pem(cert))
    return load_ca(d)


def server_names(cert: x509.Certificate) -> tuple[str, ...]:
    """The host names a server certificate was issued for besides loopback's (kept by a renewal)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(n for n in san.get_values_for_type(x509.DNSName) if n != "localhost")


def issue(d: Path, cn: str, ca: CA, *, server: bool, names: tuple[str, ...] = (), days: float = VALID_DAYS) -> None:
    """A new key and certificate for `cn`, signed by `ca`, each file replaced atomically (write_private). The key
    is written first: a reader between the two renames sees a new key with the old certificate, which every
    reader here refuses as a mismatch and reads again (`Credentials.client_tls`, `grpc_parts`)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca[0].subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca[1].public_key()), critical=False))
    if server:
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")), *(x509.DNSName(n) for n in names)]
        # etcd also dials itself with this certificate: it is a client certificate too.
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    cert = b.sign(ca[1], hashes.SHA256())
    write_private(d / f"{cn}.key", _key_pem(key))
    write_private(d / f"{cn}.pem", pem(cert))


def mint(d: Path, identities: list[str], *, server_names: tuple[str, ...] = ()) -> Path:
    """Create what is missing in the credentials directory `d` (the CA, the server certificate, each identity's
    certificate and nkey, etcd's root certificate); what exists is kept, so a restarted stack keeps its keys.
    `server_names`: host names the servers are reached by besides loopback (compose: `nats`, `etcd`)."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    ca = _load_ca(d)
    if not (d / f"{SERVER}.pem").exists():
        issue(d, SERVER, ca, server=True, names=server_names)
    for ident in [ROOT, *identities]:
        if not (d / f"{ident}.pem").exists():
            issue(d, ident, ca, server=False)
        if ident != ROOT and not (d / f"{ident}.nk").exists():
            seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
            write_private(d / f"{ident}.nk", seed)
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
        creds.refuse_if_expired()
        return creds

    def refuse_if_expired(self, now: dt.datetime | None = None) -> None:
        """`CredentialsExpired` when this identity's certificate is out of its validity window: no server would
        take it, and "handshake failed" in a reconnect loop would hide why."""
        cert = read_pem(self.cert)[0]
        refuse_if_expired(CertInfo.of(self.cert.name, cert, []), self.cert, now or dt.datetime.now(dt.UTC))

    def signature(self) -> tuple[tuple[int, int, int], ...]:
        """Identifies the files' versions (inode, mtime, size): a rotation replaces them (write_private), which
        changes it; a client holding TLS built from older files builds it again (renewal.py)."""
        out = []
        for p in (self.ca, self.cert, self.key):
            st = p.stat()
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

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
        """Verifies the server against the CA bundle (hostname included); presents this identity's certificate.
        Read from the files each call; a read between a rotation's two renames (new key, old certificate) is a
        mismatch, read again."""
        for attempt in range(PAIR_READS):
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
            try:
                ctx.load_cert_chain(str(self.cert), str(self.key))
                return ctx
            except ssl.SSLError:
                if attempt == PAIR_READS - 1:
                    raise
                time.sleep(PAIR_RETRY_S)
        raise AssertionError("unreachable")

    def grpc_parts(self) -> tuple[bytes, bytes, bytes]:
        """(CA, key, certificate) as gRPC's ssl_channel_credentials wants them: a key and certificate that belong
        together (gRPC would only find out at the handshake), read again across a rotation's renames."""
        for _ in range(PAIR_READS):
            key, cert = self.key.read_bytes(), self.cert.read_bytes()
            public = serialization.load_pem_private_key(key, None).public_key()
            if x509.load_pem_x509_certificate(cert).public_key() == public:
                return self.ca.read_bytes(), key, cert
            time.sleep(PAIR_RETRY_S)
        raise CredentialsError(f"{self.key} is not the key of {self.cert}")
