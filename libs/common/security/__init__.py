"""Authentication and authorization of the bus (NATS) and the store (etcd).

Every connection authenticates as one *identity* (policy.py) and runs over TLS against the cluster's CA:
NATS with the identity's nkey (nats-py signs the server's nonce; the seed never leaves the process), etcd with
the identity's client certificate (its CN is the etcd user). What an identity may touch is decided by the
servers (nats-server's subject permissions, etcd's RBAC), not by the clients, so a stolen or forged client
gets only what its credential allows. `holdfast up` and the test fixtures mint dev credentials once per
state directory (pki.mint); production mounts the same files (docs/security.md). Certificates are rotated in
place with nothing stopped (rotation.py, `holdfast certs`); clients take them up at their next connection
(renewal.py), and a process refuses to start on an expired one (certs.py, `CredentialsExpired`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from libs.common.security.certs import CredentialsError, CredentialsExpired
from libs.common.security.pki import Credentials, CredentialsMissing, mint
from libs.common.security.policy import ADMIN, identities, identity_for, manages_stream
from libs.common.security.renewal import GrpcTls, RenewingNATS


class _TlsEofNoise(logging.Filter):
    """asyncio warns on every TLS connection nats-py closes (its protocol returns True from eof_received, which
    TLS ignores): harmless, and it would fill every log once TLS is on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_TlsEofNoise())

__all__ = ["ADMIN", "Credentials", "CredentialsError", "CredentialsExpired", "CredentialsMissing", "GrpcTls",
           "RenewingNATS", "credentials_for", "identities", "identity_for", "manages_stream", "mint"]


def credentials_for(credentials_dir: Path, source: str, node: str, *, nats: bool = True) -> Credentials:
    """The credentials a connection of `source` on `node` uses; `CredentialsMissing` says what is absent."""
    return Credentials.load(credentials_dir, identity_for(source, node), nats=nats)
