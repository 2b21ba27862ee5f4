"""Clients that take up rotated certificates without a restart (rotation.py writes them; docs/security.md).

A TLS connection is authenticated once, at its handshake: an established connection carries on whatever the
files say later, and only a new connection needs the new certificate. So each client builds its TLS from the
files when it next connects, if they changed since it last read them:
- nats-py reads its `ssl_context` property at every connect and reconnect: `RenewingNATS` answers it from the
  files (the context is built again only when their signature changed);
- gRPC (aetcd) keeps a channel's credentials for the channel's life, reconnects included, and Python's gRPC
  has no file-watching credentials for a client: `GrpcTls.changed` tells the store's client to open a new
  channel for its next calls (store._EtcdClient), the old one kept for what still runs on it (a watch stream).
A file read mid-rotation or a broken file is not taken up: the last good TLS is kept, and logged.
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any

import grpc
from nats.aio.client import Client as NATS

from libs.common.security.certs import CredentialsError
from libs.common.security.pki import Credentials

log = logging.getLogger("holdfast.security")

CHECK_EVERY_S = 1.0  # how often a busy etcd client looks at its files (three stat calls)


class _FromFiles:
    """The last good TLS built from `creds`' files, and their signature when it was built."""

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self.signature: tuple[Any, ...] | None = None
        self.value: Any = None

    def get(self, build: Any) -> Any:
        try:
            sig = self.creds.signature()
        except OSError:
            if self.value is None:
                raise
            return self.value  # a file missing for a moment: nothing to take up yet
        if sig == self.signature:
            return self.value
        try:
            self.value = build()
            log.info("TLS of %s built from %s", self.creds.identity, self.creds.dir)
        except (OSError, ValueError, ssl.SSLError, CredentialsError) as e:
            if self.value is None:
                raise
            log.warning("credentials of %s in %s unusable (%s): keeping the last good ones", self.creds.identity,
                        self.creds.dir, e)
        self.signature = sig  # not tried again until the files change again
        return self.value


class RenewingNATS(NATS):
    """nats-py's client, its TLS built from the credentials' files at each (re)connect that finds them changed."""

    def __init__(self, creds: Credentials | None) -> None:
        super().__init__()
        self._tls_files = None if creds is None else _FromFiles(creds)

    @property
    def ssl_context(self) -> ssl.SSLContext:
        if self._tls_files is None:
            return super().ssl_context
        return self._tls_files.get(self._tls_files.creds.client_tls)  # type: ignore[no-any-return]


class GrpcTls:
    """gRPC channel credentials from an identity's files; `renewed` gives new ones (looking at most once a
    CHECK_EVERY_S) when the files changed since they were last read, and read well."""

    def __init__(self, creds: Credentials, check_every_s: float = CHECK_EVERY_S) -> None:
        self._files = _FromFiles(creds)
        self._check_every_s = check_every_s
        self._next_check = 0.0

    def credentials(self) -> grpc.ChannelCredentials:
        return self._files.get(lambda: grpc.ssl_channel_credentials(*self._files.creds.grpc_parts()))  # type: ignore[no-any-return]

    def renewed(self) -> grpc.ChannelCredentials | None:
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self._check_every_s
        before = self._files.value
        try:
            after = self.credentials()
        except (OSError, ValueError, CredentialsError):
            return None  # a file missing or unreadable: the last good ones stay (logged by _FromFiles)
        return None if after is before else after
