"""Server-side set-up from a credentials directory: nats-server's config (TLS, nkey users, permissions) and
etcd's flags (TLS, client certificates) and RBAC (users, roles, key ranges, auth on)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from aetcd import rpc

from libs.common.security.pki import SERVER, Credentials, nkey_public
from libs.common.security.policy import ROOT, KeyRange, etcd_ranges, nats_permissions


def nats_config(d: Path, identities: list[str], *, prefix: str, stream: str) -> str:
    """nats-server's config (JSON is valid NATS config): TLS required on every client link, with a client
    certificate from the trust bundle (`verify`: as etcd; a retired CA's certificates are refused after a
    reload, rotation.py), one nkey user per identity with its permissions, replies allowed to what each was
    asked (`allow_responses`)."""
    users = []
    for ident in identities:
        perms = nats_permissions(ident, prefix, stream)
        user: dict[str, object] = {"nkey": nkey_public(d, ident)}
        if perms.publish is not None:
            user["permissions"] = {"publish": {"allow": list(perms.publish)},
                                   "subscribe": {"allow": list(perms.subscribe or ())},
                                   "allow_responses": True}
        users.append(user)
    conf = {
        "tls": {"cert_file": str(d / f"{SERVER}.pem"), "key_file": str(d / f"{SERVER}.key"),
                "ca_file": str(d / "ca.pem"), "verify": True, "timeout": 2},
        "authorization": {"users": users, "timeout": 2},
    }
    return json.dumps(conf, indent=1)


def write_nats_config(path: Path, d: Path, identities: list[str], *, prefix: str, stream: str) -> Path:
    path.write_text(nats_config(d, identities, prefix=prefix, stream=stream))
    path.chmod(0o600)
    return path


def etcd_tls_flags(d: Path) -> list[str]:
    """etcd serves clients over TLS only and trusts client certificates from the CA; with auth on, a client
    certificate's CN is its user name."""
    return ["--cert-file", str(d / f"{SERVER}.pem"), "--key-file", str(d / f"{SERVER}.key"),
            "--trusted-ca-file", str(d / "ca.pem"), "--client-cert-auth"]


def _perm(r: KeyRange) -> rpc.Permission:
    key, end = r.bounds()
    kind = rpc.Permission.READWRITE if r.write else rpc.Permission.READ
    return rpc.Permission(permType=kind, key=key, range_end=end)


RangesOf = Callable[[str, str], list[KeyRange]]


def etcd_setup(target: str, d: Path, identities: list[str], *, prefix: str, timeout: float = 15.0,
               ranges: RangesOf = etcd_ranges) -> None:
    """Create (idempotently) root, one user and one role per identity with its key ranges, and turn auth on.
    Runs as `root` (its certificate), the only use of that user. Retries while etcd is still starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _etcd_setup_once(target, d, identities, prefix=prefix, ranges=ranges)
            return
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or \
                    time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _etcd_setup_once(target: str, d: Path, identities: list[str], *, prefix: str, ranges: RangesOf,
                     timeout: float = 5.0) -> None:
    ca, key, cert = Credentials(d, ROOT).grpc_parts()
    channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(ca, key, cert))
    try:
        stub = rpc.AuthStub(channel)
        no_password = rpc.UserAddOptions(no_password=True)
        for user in [ROOT, *identities]:
            _ignore_exists(lambda u=user: stub.UserAdd(rpc.AuthUserAddRequest(name=u, options=no_password), timeout=timeout))
        _ignore_exists(lambda: stub.RoleAdd(rpc.AuthRoleAddRequest(name=ROOT), timeout=timeout))
        stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=ROOT, role=ROOT), timeout=timeout)
        for ident in identities:
            _ignore_exists(lambda i=ident: stub.RoleAdd(rpc.AuthRoleAddRequest(name=i), timeout=timeout))
            for r in ranges(ident, prefix):
                stub.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=ident, perm=_perm(r)), timeout=timeout)
            stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=ident, role=ident), timeout=timeout)
        stub.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout)
    finally:
        channel.close()


def _ignore_exists(call) -> None:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as e:
        if "already exists" not in (e.details() or ""):
            raise
