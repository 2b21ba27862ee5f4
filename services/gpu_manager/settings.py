"""gpu_manager settings (environment `HF_*`, or flags)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from libs.common.config import CommonSettings


def default_socket_path(state_dir: Path) -> Path:
    return state_dir / "gpu_manager.sock"


class GpuManagerSettings(CommonSettings):
    backend: str = Field("auto", description="host, cuda, or auto (cuda when a GPU is present, else host)")
    gpus: list[str] = Field(default_factory=list, description="cuda: GPUs to manage by index or UUID (empty: all); "
                            "host: the simulated GPUs, each an even share of the capacity (empty: one, 0)")
    gpu_links: list[str] = Field(default_factory=list, description="host: the simulated GPUs joined by NVLink, as "
                                 "pairs of indexes ('0-1'); cuda: read from NVML, this ignored")
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
    gpu_publish_interval_s: float = Field(0.5, gt=0, description="how often gpus/<node>/<gpu> (leased bytes) is "
                                          "recomputed and written when it changed")
    host_capacity_bytes: int | None = Field(None, description="host backend: most bytes leased at once; default "
                                            "host_capacity_fraction of the host's (or its cgroup's) memory")
    host_capacity_fraction: float = Field(0.8, gt=0, le=1, description="host backend without host_capacity_bytes: "
                                          "this fraction of MemTotal, or of the cgroup's memory.max if lower")
    max_frame_bytes: int = Field(16 * 1024 * 1024, description="largest protocol frame accepted")
    # Limits of one client (issue 18): each is refused with a typed error reply, the connection kept.
    max_chunks_per_lease: int = Field(16384, gt=0, description="most chunks (one fd each) in one lease")
    max_fds_per_client: int = Field(65536, gt=0, description="most chunk fds of live leases owned by one process "
                                    "(less where fd_share_per_client of RLIMIT_NOFILE is less)")
    fd_share_per_client: float = Field(0.25, gt=0, le=1, description="most chunk fds of one process, as a share of "
                                       "the manager's soft RLIMIT_NOFILE at the allocate: a small machine's limit is "
                                       "below max_fds_per_client, and one process must not take every fd")
    max_connections_per_uid: int = Field(512, gt=0, description="most open engine connections of one uid")
    max_connections_per_pid: int = Field(384, gt=0, description="most open engine connections of one process: "
                                         "below the uid's limit, which the node's engines share, so one process "
                                         "leaking them leaves the others room (an engine needs a few)")
    fd_reserve: int = Field(256, ge=0, description="fds an allocate must leave free under RLIMIT_NOFILE (accepts, "
                                                   "the keeper, the database, NATS)")
    # Deadlines on the engine socket: a silent or half-open connection costs an fd, not forever.
    hello_timeout_s: float = Field(10.0, gt=0, description="a new connection must complete its hello within this")
    frame_timeout_s: float = Field(10.0, gt=0, description="a frame, once its first byte came, must be whole within")
    idle_timeout_s: float = Field(3600.0, ge=0, description="a connection silent this long after hello is closed "
                                                            "(the SDK reconnects by itself); 0: never")
    unleased_idle_timeout_s: float = Field(60.0, ge=0, description="the same for a connection whose process holds "
                                           "no lease (engines heartbeat every 0.5 s); 0: idle_timeout_s applies")

    # Weight artifacts and the host tier (issue 21; docs/restore.md).
    artifact_dir: Path | None = Field(None, description="where weight artifacts are written and restored from; "
                                      "default <state_dir>/artifacts")
    snapshot_classes: list[str] = Field(default_factory=list, description="engine classes whose weights are "
                                        "written to an artifact once, after an engine's first load")
    host_tier_classes: list[str] = Field(default_factory=list, description="engine classes whose weights the "
                                         "node keeps a copy of in host memory (memfd, held by the keeper)")
    host_tier_bytes: int = Field(0, ge=0, description="most bytes the host tier may hold (0: no host tier)")
    host_tier_pin: bool = Field(True, description="cuda: page-lock each host tier copy in place when written "
                                "(restores DMA from it); false: restores go through pinned bounce buffers")
    peer_classes: list[str] = Field(default_factory=list, description="engine classes whose committed weights "
                                    "leases are hashed once after their commit, so another engine's restore may copy "
                                    "them GPU to GPU (a lease copied to an artifact or the host tier is hashed then)")
    peer_gate: str = Field("", description="tests only: a FIFO a peer restore waits on (opened for reading) after "
                           "its peer is held and before its blocks are copied")
    io_workers: int = Field(0, ge=0, description="blocks in flight when writing or restoring an artifact "
                                                 "(0: the cores, 2..16)")
    artifact_block_bytes: int = Field(64 * 1024 * 1024, ge=4096, multiple_of=4096,
                                      description="unit of artifact I/O and hashing (a multiple of 4 KiB)")
    artifact_file_bytes: int = Field(4 * 1024**3, ge=4096, multiple_of=4096,
                                     description="bytes per artifact file (a multiple of the block)")
    direct_io: bool = Field(True, description="O_DIRECT for artifact files where the filesystem allows it")
    metrics_host: str = Field("127.0.0.1", description="address of the Prometheus /metrics server")
    metrics_port: int | None = Field(None, ge=0, description="port of the Prometheus /metrics server (0: a free "
                                     "one, in health's metrics_port); none: not served")

    def artifact_root(self) -> Path:
        return self.artifact_dir or self.state_dir / "artifacts"

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
