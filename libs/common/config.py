"""Settings shared by every service. Each service subclasses `CommonSettings` with its own fields.

Environment variables use the prefix `HF_` (`HF_NATS_URL`, `HF_NODE`...). Defaults avoid a system NATS on
4222 and a system etcd on 2379 so that a developer's local stack never collides with them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from libs.common.private_path import not_private

log = logging.getLogger("holdfast.config")

DEFAULT_NATS_PORT = 14222
DEFAULT_ETCD_PORT = 12379
DEFAULT_API_PORT = 18080
DEFAULT_ROUTER_PORT = 18000


def default_state_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"holdfast-{os.getuid()}"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HF_", extra="ignore", env_nested_delimiter="__")

    nats_url: str = Field(f"nats://127.0.0.1:{DEFAULT_NATS_PORT}", description="NATS server URL(s), comma-separated")
    etcd_endpoints: str = Field(f"127.0.0.1:{DEFAULT_ETCD_PORT}", description="etcd host:port, comma-separated")
    subject_prefix: str = Field("hf", description="prefix of every NATS subject")
    etcd_prefix: str = Field("/holdfast/", description="prefix of every etcd key")
    stream_name: str = Field("HOLDFAST", description="JetStream stream holding durable events")
    stream_replicas: int = Field(1, ge=1, le=5, description="copies of that stream (3 on a 3-server NATS cluster)")
    node: str = Field("node-1", description="this node's id")
    datacenter: str = Field("dc-1", description="this node's datacenter or zone")
    state_dir: Path = Field(default_factory=default_state_dir, description="sockets, databases, scratch")
    otel_endpoint: str | None = Field(None, description="OTLP/HTTP endpoint; none: telemetry is not exported")
    log_level: str = "INFO"
    log_json: bool = Field(False, description="one JSON object a log line")
    request_timeout_s: float = Field(2.0, description="default timeout of NATS request/reply")
    credentials_dir: Path | None = Field(
        None, description="CA, certificates and NATS nkeys (libs/common/security); default: <state_dir>/credentials")
    insecure: bool = Field(False, description="connect to NATS and etcd without TLS or credentials (servers with auth off)")

    def to_env(self) -> dict[str, str]:
        """The shared settings as `HF_*` variables, for a child process that must see the same cluster."""
        return {
            "HF_NATS_URL": self.nats_url,
            "HF_ETCD_ENDPOINTS": self.etcd_endpoints,
            "HF_SUBJECT_PREFIX": self.subject_prefix,
            "HF_ETCD_PREFIX": self.etcd_prefix,
            "HF_STREAM_NAME": self.stream_name,
            "HF_STREAM_REPLICAS": str(self.stream_replicas),
            "HF_NODE": self.node,
            "HF_DATACENTER": self.datacenter,
            "HF_STATE_DIR": str(self.state_dir),
            "HF_LOG_LEVEL": self.log_level,
            "HF_CREDENTIALS_DIR": str(self.credentials()),
            "HF_INSECURE": "1" if self.insecure else "0",
        }

    def credentials(self) -> Path:
        """Where this process's credentials lie (a child process is told the same with `to_env`)."""
        return self.credentials_dir if self.credentials_dir is not None else self.state_dir / "credentials"

    def ensure_state_dir(self) -> Path:
        """The state directory, this uid's and closed to others (0700): it holds the sockets, the lease database,
        tokens and credentials. One made before with a looser mode (by hand, by an older release, under another
        umask) is closed now and said so; one of another uid, or one others may write in (a shared /tmp), is refused:
        they could have swapped what lies in it."""
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = self.state_dir.stat()
        if (why := not_private(st)) is not None:  # others could have planted sockets or files: too late to close
            raise PermissionError(f"the state directory {self.state_dir} {why}: choose a directory of this uid's "
                                  "alone, or give it to this uid (HF_STATE_DIR)")
        if st.st_mode & 0o077:
            self.state_dir.chmod(0o700)
            log.warning("the state directory %s was open to others (mode %o): now 0700", self.state_dir,
                        st.st_mode & 0o777)
        return self.state_dir

    def etcd_hosts(self) -> list[tuple[str, int]]:
        out = []
        for item in self.etcd_endpoints.split(","):
            item = item.strip().removeprefix("http://")
            host, _, port = item.rpartition(":")
            out.append((host or "127.0.0.1", int(port)))
        return out
