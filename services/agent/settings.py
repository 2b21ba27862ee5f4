"""The agent's settings (flags `--engines-file`..., or env `HF_ENGINES_FILE`...)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from libs.common.config import CommonSettings
from libs.common.events import EngineSpec


class AgentSettings(CommonSettings):
    engines_file: Path | None = Field(None, description="JSON list of EngineSpec to run on this node")
    engines: list[EngineSpec] = Field(default_factory=list, description="engine specs inline (JSON, env HF_ENGINES)")
    metrics_host: str = Field("127.0.0.1", description="address of the Prometheus /metrics server")
    metrics_port: int | None = Field(None, ge=0, description="port of the Prometheus /metrics server (0: a free "
                                     "one, in health's metrics_port); none: not served")
    agent_socket: Path | None = Field(None, description="engines' unix socket; default <state_dir>/agent.sock")
    socket_mode: int = Field(0o600, description="permissions of the engines' socket (the uid check holds whatever they are)")
    allowed_uids: list[int] = Field(default_factory=list, description="uids whose processes may register on the "
                                    "socket (SO_PEERCRED); empty: the agent's own uid only")
    register_timeout_s: float = Field(5.0, gt=0, description="a connection to the engines' socket must have sent "
                                      "its whole `register` within this of the connect (link_server.py rule 4)")
    frame_timeout_s: float = Field(5.0, gt=0, description="a frame from an engine, once begun, must be whole within "
                                   "this; a reply to it must be taken within this too")
    max_links: int = Field(256, gt=0, description="most open connections to the engines' socket (each engine holds "
                           "one; beyond it `too_many_connections`)")
    max_links_per_pid: int = Field(4, gt=0, description="most open connections to the engines' socket of one process "
                                   "(an engine holds one, two for a moment as its link reconnects)")
    gpu_manager_socket: Path | None = Field(None, description="passed to engines; default <state_dir>/gpu_manager.sock")
    heartbeat_timeout_s: float = Field(1.0, description="heartbeats missing this long: the engine is hung")
    start_heartbeat_timeout_s: float = Field(10.0, description="the same while an engine starts (not yet ready or "
                                             "standing by): imports and weight loads hold its interpreter for "
                                             "seconds on a loaded machine, and it serves nobody yet")
    probe_interval_s: float = Field(5.0, ge=0, description="how often a serving engine's HTTP server is asked "
                                    "GET /health (0: never): heartbeats come from a thread of their own, so an "
                                    "engine whose server is stuck still heartbeats")
    probe_timeout_s: float = Field(5.0, gt=0, description="a probe not answered within this has failed")
    probe_failures: int = Field(3, ge=1, description="probes failed in a row before the engine is declared hung")
    node_ttl_s: int = Field(3, description="etcd lease of nodes/<node>: a dead agent's node key vanishes after this")
    stop_timeout_s: float = Field(5.0, description="SIGTERM, then SIGKILL after this long")
    takeover_timeout_s: float = Field(15.0, description="a standby must be ready this long after its assignment")
    takeover_wait_s: float = Field(60.0, description="a failed active engine waits this long for a takeover "
                                   "before the agent replaces it with a fresh (non-reattaching) engine")
    fallback_wait_s: float = Field(5.0, ge=0, description="a failed active engine whose memory was lost (a GPU fault) "
                                   "keeps its slot this long for the control plane's fallback successor (one that "
                                   "continues it from its KV backup, or a spare), before the agent replaces it itself")
    promote_locally: bool = Field(False, description="an active engine that dies on a sound GPU, with a standby "
                                  "beside it that shadows it and fences itself, is taken over by this agent (its "
                                  "leases frozen on this node's gpu_manager, then the standby assigned) under the "
                                  "incident's own id, without waiting for the control plane, whose freeze and "
                                  "takeover then find it done. Off by default: on an H100 it assigned the standby "
                                  "~1 ms later than the dc_manager's early promotion (services/agent/README.md)")
    standby_refill_delay_s: float = Field(0.25, ge=0, description="a takeover's replacement standby is started "
                                          "this long after its reply (its spawn and start-up must not delay it)")
    exit_poll_ms: float = Field(2.0, gt=0, description="how often engines are checked for a death in progress "
                                "(/proc PF_EXITING): a CUDA process's teardown takes ~100 ms before its pidfd says dead")
    death_marks: bool | None = Field(None, description="wait on the death marks engines send (libs/common/"
                                     "death_mark.py, mark_waiter.py) beside the poll; unset: on where the agent may "
                                     "run on more than 2 CPUs. On a 16-core H100 host a death was published sooner at "
                                     "p50 and p99 (1.8 / 2.6 against 2.8 / 3.8 ms); on the 2-core test machine sooner "
                                     "at p50, later at p99 (docs/benchmarks.md, \"Failure detection\")")
    stranger_wait_s: float = Field(0.5, ge=0, description="after start-up, engines are started only this long after "
                                   "the agent's socket listens: engines a previous agent started and never recorded "
                                   "register again first (every 50 ms) and keep their slots, warm")
    reconcile_interval_s: float = Field(0.5, description="how often the desired engines are compared with the live ones")
    crash_backoff_base_s: float = Field(0.5, gt=0, description="an engine spec failing again soon after a "
                                        "start: its next start waits this long, doubling each time")
    crash_backoff_max_s: float = Field(30.0, gt=0, description="the crash-loop backoff's cap")
    crash_backoff_reset_s: float = Field(10.0, gt=0, description="an engine up this long ends its spec's "
                                         "crash loop (the backoff starts over)")
    gpus: list[int | str] = Field(default_factory=list, description="GPUs of this node by index or UUID (NVML: all "
                                  "visible when empty); without NVML the simulated GPUs of the host backend, as the "
                                  "gpu_manager's `gpus` (empty: one, 0)")
    nvml: bool = Field(True, description="watch GPU health through NVML when it is available")

    def socket_path(self) -> Path:
        return self.agent_socket or self.state_dir / "agent.sock"

    def peer_uids(self) -> frozenset[int]:
        import os

        return frozenset(self.allowed_uids or [os.getuid()])

    def marks_on(self) -> bool:
        """`death_marks`, or where unset: whether the agent may run on more than 2 CPUs (its affinity, as a cgroup's
        cpuset or `taskset` narrows it). Two are where the mark's waiter was seen waking late (mark_waiter.py)."""
        import os

        return self.death_marks if self.death_marks is not None else len(os.sched_getaffinity(0)) > 2

    def gpu_manager_path(self) -> Path:
        return self.gpu_manager_socket or self.state_dir / "gpu_manager.sock"

    def load_specs(self) -> list[EngineSpec]:
        specs = list(self.engines)
        if self.engines_file is not None:
            from pydantic import TypeAdapter

            specs += TypeAdapter(list[EngineSpec]).validate_json(self.engines_file.read_bytes())
        return specs
