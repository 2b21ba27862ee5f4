"""Certificate rotation in a credentials directory, with nothing stopped (`holdfast certs`; docs/security.md).

Three steps, each one command, each leaving the directory usable by every server and client at every moment:
1. `rotate_ca`: a new CA. The trust bundle `ca.pem` becomes [new CA, previous CA] and `ca.key` the new key;
   no leaf changes, so every certificate in use stays trusted. `ca-overlap.json` records until when the
   previous CA is kept (the overlap: time for every holder of credentials to pick up the new bundle).
2. `rotate_certificates`: every leaf (the servers', each identity's, etcd root's) issued again by the current
   CA, each with a new key; the old ones stay valid (their CA is still in the bundle) until step 3.
3. `retire_ca`: the bundle back to the current CA alone, once the overlap has ended and no leaf in the
   directory still needs the previous CA. From then a certificate of the previous CA is refused by nats-server
   (after its reload) and by etcd (on its next connection).
Step 2 alone is the routine renewal. Servers pick the files up as follows (measured by
tests/common/test_security_rotation.py): nats-server all of them on SIGHUP (`reload_nats`); etcd (3.4) its own
certificate at each new handshake, with no signal, but its trusted CAs at start only, so steps 1 and 3 need each
etcd member restarted (one at a time in a cluster) before step 2 and after step 3. Our clients build TLS from the
files at their next connection (renewal.py); established connections carry on through all of it.

Invariants:
1. every file is replaced atomically, 0600 (pki.write_private); `ca.pem` is written before `ca.key`, so between
   the two `ca.key` still matches a CA of the bundle (pki.load_ca) and a concurrent `mint` signs with a
   trusted CA either way;
2. the bundle holds at most two CAs, the current first; a second `rotate_ca` waits for `retire_ca`;
3. `retire_ca` never strands a certificate of this directory: it refuses while one is still signed only by a
   CA it would drop (unless forced, for one known to be revoked).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from libs.common.errors import HoldfastError
from libs.common.security.certs import WARN_DAYS, CertInfo, CertState, read_pem, state_of
from libs.common.security.pki import (
    SERVER,
    VALID_DAYS,
    CredentialsMissing,
    _key_pem,
    issue,
    load_ca,
    new_ca,
    pem,
    server_names,
    write_private,
)

OVERLAP_FILE = "ca-overlap.json"
OVERLAP_DAYS = 7.0


class RotationRefused(HoldfastError):
    code = "rotation_refused"


def leaf_names(d: Path) -> list[str]:
    """Every leaf certificate of the directory (`<name>.pem` but the bundle), by name without `.pem`."""
    return sorted(p.stem for p in d.glob("*.pem") if p.name != "ca.pem")


def _current_ca(d: Path) -> tuple:  # type: ignore[type-arg]
    if not (d / "ca.key").is_file():
        raise CredentialsMissing(f"no CA key in {d} (ca.key): rotate where the CA key is kept (production keeps "
                                 "it out of the cluster), then hand each identity its new files")
    return load_ca(d)


def rotate_certificates(d: Path, *, days: float = VALID_DAYS) -> list[str]:
    """Step 2: every leaf issued again by the current CA, with a new key; the server's host names kept."""
    ca = _current_ca(d)
    names = leaf_names(d)
    for name in names:
        server = name == SERVER
        hosts = server_names(read_pem(d / f"{name}.pem")[0]) if server else ()
        issue(d, name, ca, server=server, names=hosts, days=days)
    return names


@dataclass(frozen=True)
class Overlap:
    retire_after: dt.datetime
    previous: tuple[str, ...]  # the previous CAs' SHA-256 fingerprints

    def to_json(self) -> bytes:
        return json.dumps({"retire_after": self.retire_after.isoformat(), "previous": list(self.previous)}).encode()

    @classmethod
    def read(cls, d: Path) -> Overlap | None:
        path = d / OVERLAP_FILE
        if not path.is_file():
            return None
        raw = json.loads(path.read_bytes())
        return cls(dt.datetime.fromisoformat(raw["retire_after"]), tuple(raw["previous"]))


def rotate_ca(d: Path, *, overlap_days: float = OVERLAP_DAYS, days: float = VALID_DAYS,
              now: dt.datetime | None = None) -> Overlap:
    """Step 1: a new CA, trusted next to the current one until `retire_ca` (invariants 1, 2)."""
    now = now or dt.datetime.now(dt.UTC)
    if Overlap.read(d) is not None:
        raise RotationRefused(f"a CA rotation is already under way in {d}: `holdfast certs retire-ca` ends it first")
    old_cert, _ = _current_ca(d)
    cert, key = new_ca(days)
    ov = Overlap(now + dt.timedelta(days=overlap_days), (CertInfo.of("ca.pem", old_cert, []).fingerprint,))
    write_private(d / OVERLAP_FILE, ov.to_json())
    write_private(d / "ca.pem", pem(cert) + pem(old_cert))
    write_private(d / "ca.key", _key_pem(key))
    return ov


def retire_ca(d: Path, *, now: dt.datetime | None = None, force: bool = False) -> list[str]:
    """Step 3: the bundle back to the current CA alone; returns the fingerprints dropped (invariant 3)."""
    now = now or dt.datetime.now(dt.UTC)
    ov = Overlap.read(d)
    if ov is None:
        raise RotationRefused(f"no CA rotation under way in {d} (no {OVERLAP_FILE})")
    if now < ov.retire_after and not force:
        raise RotationRefused(f"the previous CA is trusted until {ov.retire_after:%Y-%m-%d %H:%M} UTC (the overlap "
                              "other holders of these credentials may still need); --force retires it now")
    current, _ = _current_ca(d)
    stranded = [n for n in leaf_names(d) if not CertInfo.of(n, read_pem(d / f"{n}.pem")[0], [current]).issuer_trusted]
    if stranded and not force:
        raise RotationRefused(f"still signed by the previous CA: {', '.join(stranded)}: `holdfast certs rotate` "
                              "first (or --force, and they are locked out)")
    dropped = [CertInfo.of("ca.pem", c, []).fingerprint for c in read_pem(d / "ca.pem") if c != current]
    write_private(d / "ca.pem", pem(current))
    (d / OVERLAP_FILE).unlink()
    return dropped


@dataclass(frozen=True)
class Row:
    info: CertInfo
    state: CertState
    role: str  # "current CA", "previous CA", or the leaf's name


def survey(d: Path, *, now: dt.datetime | None = None, warn_days: float = WARN_DAYS) -> list[Row]:
    """Every certificate of the directory with its state (certs.state_of), the bundle's CAs first."""
    now = now or dt.datetime.now(dt.UTC)
    bundle = read_pem(d / "ca.pem")
    rows = [Row(CertInfo.of("ca.pem", c, bundle), CertState.OK, "current CA" if i == 0 else "previous CA")
            for i, c in enumerate(bundle)]
    rows = [Row(r.info, state_of(r.info, now, warn_days), r.role) for r in rows]
    for name in leaf_names(d):
        info = CertInfo.of(f"{name}.pem", read_pem(d / f"{name}.pem")[0], bundle)
        rows.append(Row(info, state_of(info, now, warn_days), name))
    return rows


def reload_nats(pid: int) -> None:
    """SIGHUP: nats-server reads its config again, TLS files included (new connections get them; established
    ones stay). Refuses a pid that is not a nats-server, so a typo does not hang up another process."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        raise RotationRefused(f"no process {pid}") from None
    if comm != "nats-server":
        raise RotationRefused(f"process {pid} is {comm!r}, not nats-server")
    os.kill(pid, signal.SIGHUP)
