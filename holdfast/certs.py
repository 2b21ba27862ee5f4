"""`holdfast certs`: the credentials' certificates, their days left, and their rotation with nothing stopped
(libs/common/security/rotation.py says the three steps; docs/security.md the procedure). Only typer and rich at
import: the crypto loads when a command runs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

certs_app = typer.Typer(help="Certificates: status, rotation (docs/security.md).", no_args_is_help=True)
console = Console()

DIR = typer.Option(..., "--dir", envvar="HF_CREDENTIALS_DIR", help="the credentials directory")
NATS_PID = typer.Option([], "--nats-pid", help="a nats-server to reload (SIGHUP) once the files are written")


def _refused(e: Exception) -> typer.Exit:
    console.print(f"[red]{e}[/red]")
    return typer.Exit(2)


def _reload(pids: list[int], *, ca_changed: bool) -> None:
    from libs.common.security.rotation import reload_nats

    for pid in pids:
        reload_nats(pid)
        console.print(f"nats-server {pid}: reloading its config (SIGHUP)")
    if not pids:
        console.print("reload each nats-server now (SIGHUP; `--nats-pid`)")
    if ca_changed:  # measured: etcd 3.4 reads --trusted-ca-file at start only (tests/common/test_security_rotation.py)
        console.print("restart each etcd member now, one at a time: etcd reads its trusted CAs at start only")
    else:
        console.print("etcd takes the new files at its next handshake; our clients at their next connection")


@certs_app.command("status")
def status(dir: Path = DIR, warn_days: float = typer.Option(30.0, help="fewer days left than this: expiring")) -> None:
    """Every certificate with its days left; exit status 1 if one is expired, untrusted or not yet valid, so a
    monitor can run it."""
    from libs.common.security.certs import CertState, CredentialsError
    from libs.common.security.rotation import Overlap, survey

    try:
        rows = survey(dir, warn_days=warn_days)
    except CredentialsError as e:
        raise _refused(e) from None
    table = Table(title=f"certificates in {dir}")
    for col in ("file", "role", "subject", "not after (UTC)", "days left", "state"):
        table.add_column(col)
    now = dt.datetime.now(dt.UTC)
    colour = {CertState.OK: "green", CertState.EXPIRING: "yellow"}
    for r in rows:
        c = colour.get(r.state, "red")
        table.add_row(r.info.file, r.role, r.info.subject, f"{r.info.not_after:%Y-%m-%d %H:%M}",
                      f"{r.info.days_left(now):.1f}", f"[{c}]{r.state}[/{c}]")
    console.print(table)
    ov = Overlap.read(dir)
    if ov is not None:
        console.print(f"CA rotation under way: the previous CA is trusted until {ov.retire_after:%Y-%m-%d %H:%M} UTC "
                      "(`holdfast certs retire-ca` then)")
    if any(r.state not in (CertState.OK, CertState.EXPIRING) for r in rows):
        raise typer.Exit(1)


def _step(do: Callable[[], str], nats_pids: list[int], *, ca_changed: bool = False) -> None:
    """Run one rotation step, say what it did, then reload the nats-servers named; a refusal exits 2."""
    from libs.common.errors import HoldfastError

    try:
        console.print(do())
        _reload(nats_pids, ca_changed=ca_changed)
    except HoldfastError as e:
        raise _refused(e) from None


@certs_app.command("rotate")
def rotate(dir: Path = DIR, days: float = typer.Option(365.0, help="validity of the new certificates"),
           nats_pid: list[int] = NATS_PID) -> None:
    """Issue every certificate again from the current CA, each with a new key (atomic, 0600); established
    connections carry on, new ones use the new certificates."""
    from libs.common.security.rotation import rotate_certificates

    _step(lambda: f"issued again: {', '.join(rotate_certificates(dir, days=days))}", nats_pid)


@certs_app.command("rotate-ca")
def rotate_ca(dir: Path = DIR, overlap_days: float = typer.Option(7.0, help="how long the previous CA stays trusted"),
              days: float = typer.Option(3650.0, help="validity of the new CA"), nats_pid: list[int] = NATS_PID) -> None:
    """A new CA, trusted together with the current one (a bundle) for the overlap; then `rotate`, and after the
    overlap `retire-ca`."""
    from libs.common.security import rotation

    def do() -> str:
        ov = rotation.rotate_ca(dir, overlap_days=overlap_days, days=days)
        return (f"new CA in ca.pem (both trusted until {ov.retire_after:%Y-%m-%d %H:%M} UTC); "
                "next: reload and restart the servers as below, then `holdfast certs rotate`")

    _step(do, nats_pid, ca_changed=True)


@certs_app.command("retire-ca")
def retire_ca(dir: Path = DIR, force: bool = typer.Option(False, help="before the overlap's end, or stranding "
                                                          "certificates still signed by the previous CA"),
              nats_pid: list[int] = NATS_PID) -> None:
    """Trust the current CA alone: certificates of the previous one are refused from then on."""
    from libs.common.security import rotation

    _step(lambda: "no longer trusted: CA " + ", ".join(f[:16] for f in rotation.retire_ca(dir, force=force)), nats_pid,
          ca_changed=True)
