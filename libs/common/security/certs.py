"""What a certificate file says about itself, and whether it still holds: pure logic over parsed certificates (no
file or network I/O here but `read_pem`), used by `holdfast certs status`, by a service's start (an expired
certificate is refused, `CredentialsExpired`) and by the rotation's safety checks (rotation.py).

Invariants:
1. a certificate is `ok` only inside its validity window, issued by a CA of the trust bundle (`ca.pem`), and
   with more than `warn_days` left; otherwise exactly one of the other states says why, the worst first
   (expired or not yet valid, untrusted, expiring);
2. the trust bundle's first certificate is the current CA, the one whose key signs new certificates
   (rotation.py keeps it so); any other is a previous CA, trusted only until it is retired.
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from libs.common.errors import HoldfastError

WARN_DAYS = 30.0  # `holdfast certs status` calls a certificate with fewer days left `expiring`


class CredentialsError(HoldfastError):
    """A credential a process needs is missing or unusable; the message says which file and what to do."""

    code = "credentials_error"


class CredentialsExpired(CredentialsError):
    code = "credentials_expired"


class CertState(enum.StrEnum):
    OK = "ok"
    EXPIRING = "expiring"
    EXPIRED = "expired"
    NOT_YET_VALID = "not_yet_valid"
    UNTRUSTED = "untrusted"  # its issuer is no CA of the trust bundle (a retired CA's, or a stranger's)


@dataclass(frozen=True)
class CertInfo:
    file: str
    subject: str  # the CN: the identity (etcd's user), or the CA's name
    issuer: str
    not_before: dt.datetime
    not_after: dt.datetime
    fingerprint: str  # SHA-256, hex: tells two CAs of one name apart
    is_ca: bool
    issuer_trusted: bool  # signed by a CA of the trust bundle (checked by signature, not by name)

    @classmethod
    def of(cls, file: str, cert: x509.Certificate, bundle: list[x509.Certificate]) -> CertInfo:
        return cls(file=file, subject=_cn(cert.subject), issuer=_cn(cert.issuer),
                   not_before=cert.not_valid_before_utc, not_after=cert.not_valid_after_utc,
                   fingerprint=cert.fingerprint(hashes.SHA256()).hex(), is_ca=_is_ca(cert),
                   issuer_trusted=any(issued_by(cert, ca) for ca in bundle))

    def days_left(self, now: dt.datetime) -> float:
        return (self.not_after - now).total_seconds() / 86400


def _cn(name: x509.Name) -> str:
    attrs = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else name.rfc4514_string()


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def state_of(cert: CertInfo, now: dt.datetime, warn_days: float = WARN_DAYS) -> CertState:
    """Invariant 1. A CA of the bundle is judged by its dates only; a leaf must also be signed by one of them."""
    if now >= cert.not_after:
        return CertState.EXPIRED
    if now < cert.not_before:
        return CertState.NOT_YET_VALID
    if not cert.is_ca and not cert.issuer_trusted:
        return CertState.UNTRUSTED
    if cert.days_left(now) < warn_days:
        return CertState.EXPIRING
    return CertState.OK


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """`ca`'s key signed `cert` (every dev CA has one name: only the signature tells an old CA from a new one)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def read_pem(path: Path) -> list[x509.Certificate]:
    """Every certificate of a PEM file (a trust bundle holds several); `CredentialsError` when there is none."""
    try:
        certs = x509.load_pem_x509_certificates(path.read_bytes())
    except (OSError, ValueError) as e:
        raise CredentialsError(f"{path}: not a readable PEM certificate ({e})") from None
    return certs


def refuse_if_expired(cert: CertInfo, path: Path, now: dt.datetime) -> None:
    """A process does not start on a certificate that no server would accept: it says which, since when, and
    the fix (`CredentialsExpired`, exit status 2 in `run_service`)."""
    if now >= cert.not_after:
        raise CredentialsExpired(
            f"the certificate {path} ({cert.subject!r}) expired at {cert.not_after:%Y-%m-%d %H:%M} UTC: run "
            "`holdfast certs rotate` (dev stack) or mount a renewed one; `holdfast certs status` lists them all")
    if now < cert.not_before:
        raise CredentialsExpired(
            f"the certificate {path} ({cert.subject!r}) is not valid before {cert.not_before:%Y-%m-%d %H:%M} UTC "
            "(is this machine's clock right?)")
