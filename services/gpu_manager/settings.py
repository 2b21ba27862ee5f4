"""gpu_manager settings (environment `HF_*`, or flags)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from libs.common.config import CommonSettings


def default_socket_path(state_dir: Path) -> Path:
    return state_dir / "gpu_manager.sock"


class GpuManagerSettings(CommonSettings):
    backend: str = Field("auto", description="host, cuda, or auto (cuda when a GPU is present, else host)")
    gpus: list[str] = Field(default_factory=list, description="cuda: GPUs to manage by index or UUID (empty: all)")
    chunk_mib: int = Field(1024, gt=0, description="chunk size of an allocation, MiB (rounded to the granularity)")
    gpu_manager_socket: Path | None = Field(None, description="engine socket; default <state_dir>/gpu_manager.sock")
    socket_mode: int = Field(0o600, description="permissions of the engine socket")
    socket_group: str | None = Field(None, description="group owning the engine socket (then use mode 0660)")
    keeper_socket: Path | None = Field(None, description="fd keeper socket; default <state_dir>/gpu_keeper.sock")
    db_url: str | None = Field(None, description="SQLAlchemy URL of the lease table; default sqlite in state_dir")
    grace_s: float = Field(60.0, gt=0, description="orphan grace window of an engine class with no other setting")
    grace_multiple: float = Field(3.0, gt=0, description="grace = this x a class's cold-start time")
    class_cold_start_s: dict[str, float] = Field(default_factory=dict, description="engine class -> cold start, s")
    class_grace_s: dict[str, float] = Field(default_factory=dict, description="engine class -> explicit grace, s")
    reconcile_interval_s: float = Field(0.5, gt=0, description="period of the reconciler pass")
    host_capacity_bytes: int | None = Field(None, description="host backend: most bytes leased at once")
    max_frame_bytes: int = Field(16 * 1024 * 1024, description="largest protocol frame accepted")

    def socket_path(self) -> Path:
        return self.gpu_manager_socket or default_socket_path(self.state_dir)

    def keeper_path(self) -> Path:
        return self.keeper_socket or self.state_dir / "gpu_keeper.sock"

    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{self.state_dir / 'gpu_manager.db'}"

    def grace_for(self, engine_class: str) -> float:
        """A class's grace window: explicit, else a multiple of its cold-start time, else the default."""
        if engine_class in self.class_grace_s:
            return self.class_grace_s[engine_class]
        if engine_class in self.class_cold_start_s:
            return self.class_cold_start_s[engine_class] * self.grace_multiple
        return self.grace_s
