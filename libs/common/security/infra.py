"""Secured nats-server and etcd for whoever starts them (the stack, the benchmarks): mint the credentials that
are missing, write nats-server's config, give etcd its TLS flags, and set up etcd's users and roles once it
listens. One place, so that every stack and benchmark runs the same servers the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from libs.common.config import CommonSettings
from libs.common.security.pki import mint
from libs.common.security.policy import identities
from libs.common.security.servers import etcd_setup, etcd_tls_flags, write_nats_config


@dataclass
class SecureInfra:
    """`credentials`: the credentials directory (kept across restarts: same CA, same keys); `nodes`: the nodes
    whose agent and gpu_manager get an identity; `secure` False: plain servers (to measure what it costs)."""

    credentials: Path
    nodes: list[str]
    secure: bool = True
    ids: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = identities(self.nodes)

    def nats_config(self, path: Path, settings: CommonSettings) -> Path | None:
        if not self.secure:
            return None
        mint(self.credentials, self.ids)
        return write_nats_config(path, self.credentials, self.ids, prefix=settings.subject_prefix,
                                 stream=settings.stream_name)

    def etcd_flags(self) -> list[str] | None:
        if not self.secure:
            return None
        mint(self.credentials, self.ids)
        return etcd_tls_flags(self.credentials)

    def etcd_ready(self, port: int, settings: CommonSettings) -> None:
        """Once etcd listens: users, roles, key ranges, auth on (idempotent)."""
        if self.secure:
            etcd_setup(f"127.0.0.1:{port}", self.credentials, self.ids, prefix=settings.etcd_prefix)

    def settings(self, **kw: object) -> CommonSettings:
        return CommonSettings(credentials_dir=self.credentials, insecure=not self.secure, **kw)  # type: ignore[arg-type]

    def env(self) -> dict[str, str]:
        return {"HF_CREDENTIALS_DIR": str(self.credentials), "HF_INSECURE": "0" if self.secure else "1"}
