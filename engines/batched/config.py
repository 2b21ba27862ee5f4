"""Every setting of the batched engine, parsed once (flags `--max-num-seqs 256` or `HF_ENGINE_MAX_NUM_SEQS=256`)
and passed down as one object: nothing below reads the environment.

The agent sets HF_ENGINE_ID, HF_ENGINE_ROLE, HF_MODEL, HF_AGENT_SOCKET, HF_GPU_MANAGER_SOCKET, HF_GPU (and
HF_TAKEOVER_FROM + HF_TRANSFER_TOKEN for a cold-spawned successor); they are read here too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from engines.reference.settings import TensorParallelSettings


class EngineConfig(TensorParallelSettings, BaseSettings):
    """With `tp`, `tp_rank`, `tp_port`, `gang`, `takeover_gang`, `gang_generation` (engines/reference/settings.py,
    shared with the reference engine; tp.py and tp_group.py use them)."""

    model_config = SettingsConfigDict(env_prefix="HF_ENGINE_", extra="ignore", cli_prog_name="holdfast engine batched",
                                      cli_kebab_case=True, cli_implicit_flags=True)

    # the model and where it comes from
    size: str = Field("tiny", description="model size (engines/reference/config.py SIZES)")
    weights: Path = Field(description="safetensors file made by `python -m engines.reference make-weights`")
    model: str = Field("reference", validation_alias=AliasChoices("model", "HF_MODEL"),
                       description="model name the router routes by")
    device: str = Field("auto", description="auto (cuda when torch sees a GPU, else cpu), cpu, cuda, cuda:N")
    memory: Literal["auto", "leased", "local"] = Field(
        "auto", description="leased: Holdfast leases; local: plain tensors; auto: leased when a gpu_manager socket exists")
    gpu_manager_socket: str | None = Field(None, validation_alias=AliasChoices("gpu_manager_socket", "HF_GPU_MANAGER_SOCKET"))
    gpu: int = Field(0, validation_alias=AliasChoices("gpu", "HF_GPU"))
    threads: int = Field(1, ge=1, description="torch CPU threads (fixed: results do not depend on the machine's load)")

    # identity and role (the agent sets them)
    id: str = Field(default_factory=lambda: f"bat-{os.getpid()}", description="engine id")
    role: Literal["active", "standby"] = Field("active", description="standby: warm up, hold no memory, wait for an "
                                               "assignment, then adopt the predecessor's weights, KV cache and journal")
    spare: bool = Field(False, validation_alias=AliasChoices("spare", "HF_ENGINE_SPARE"),
                        description="a standby on another GPU than its predecessor's (EngineSpec.spares): it loads its "
                        "own weights at start and, once assigned, takes the predecessor's KV backup alone over (a GPU "
                        "fault lost the rest) and serves, or with no predecessor named starts serving afresh")
    takeover_from: str | None = Field(None, validation_alias=AliasChoices("takeover_from", "HF_TAKEOVER_FROM"))
    transfer_token: str | None = Field(None, validation_alias=AliasChoices("transfer_token", "HF_TRANSFER_TOKEN"))
    agent: Literal["auto", "on", "off"] = Field("auto", description="auto: link to the agent when HF_AGENT_SOCKET is set")

    # KV cache and scheduling
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    num_blocks: int | None = Field(None, ge=2, description="KV blocks (default: kv_cache_gib, or enough for "
                                   "max_num_seqs sequences of max_model_len on the CPU)")
    kv_cache_gib: float | None = Field(None, gt=0, description="KV cache size in GiB (sets num_blocks)")
    max_num_seqs: int = Field(256, ge=1, description="sequences running at once")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per step (decode tokens + prefill chunks)")
    prefill_chunk: int = Field(256, ge=1, description="largest prefill chunk; in deterministic mode chunks are cut "
                               "at multiples of it, so a sequence's numerics do not depend on the batch")
    max_model_len: int | None = Field(None, ge=2, description="context limit (default: the size's max_seq)")
    max_waiting: int = Field(10000, ge=0, description="queued requests past which new ones get 503")
    prefix_caching: bool = Field(True, description="share full KV blocks of equal prefixes")
    deterministic: bool = Field(False, description="batch-invariant kernels: a sequence's tokens do not depend on "
                                "what runs beside it (exact output through a failover)")
    deterministic_tile: int | None = Field(
        None, ge=16, multiple_of=16,
        description="deterministic mode: one-token rows per GEMM, a multiple of 16 (default 64 on CUDA, 16 on the "
                    "CPU). Each tile reads every weight: a larger one serves many streams faster and few slower "
                    "(docs/engine-batched.md); every engine of a spec must use the same")
    cuda_graphs: bool = Field(True, description="decode steps replayed as CUDA graphs at batch-size buckets (CUDA only)")
    async_schedule: bool = Field(True, description="schedule and launch step N+1 while step N runs on the device "
                                 "(engine.py); --no-async-schedule: one step at a time")

    # recovery
    adopt_claim_s: float = Field(30.0, gt=0, description="an adopted sequence that no resumed request claims in this "
                                 "long is dropped and its blocks freed")
    hold_s: float = Field(10.0, ge=0, description="a request that comes before the engine serves (a standby that "
                          "routers were told will take over) waits this long for it, then gets 503; 0: 503 at once")
    loop_watch_s: float = Field(0.0, ge=0, description="> 0: a request held while the engine takes over starts a watch "
                                "of the HTTP loop for this long; its late wake-ups (ms after the assignment, ms late, "
                                "CPU ms of the loop's thread meanwhile) are the recovery's `loop_late` in /health")
    adopt_wait_s: float = Field(30.0, gt=0, description="a successor waits this long for its predecessor's death to "
                                "own its leases")
    kv_backup: bool = Field(False, description="copy each step's new KV blocks to a host-memory lease at a bounded lag "
                            "(backup.py): a successor whose KV lease was lost restores from it instead of recomputing")
    kv_backup_lag_ms: float = Field(100.0, gt=0, description="the backup's lag bound: a round every half of it")
    degrade_gang: str | None = Field(
        None, validation_alias=AliasChoices("degrade_gang", "HF_DEGRADE_GANG"),
        description="a degraded successor (degrade.py): this engine (or group of fewer ranks) takes over the KV "
                    "backups of this broken tensor-parallel gang (with HF_TRANSFER_TOKEN and HF_GANG_GENERATION), "
                    "loads the weights cold and continues every backed-up sequence; its block count is the backups'")
    fenced_takeover: bool = Field(True, description="a standby is granted its predecessor's leases once the "
                                  "predecessor is stopped (can run no code), maps them during its teardown and reads "
                                  "or writes them only after its exit (the pidfd): the ~75-95 ms of a CUDA context's "
                                  "teardown overlap the takeover instead of preceding it")
    prepare_standby: bool = Field(True, description="a standby reserves its predecessor's lease addresses and captures "
                                  "its decode graphs there before any failure (__main__.py); false: after the takeover")
    drain_mark: bool = Field(True, description="on CUDA, each step-thread pass's GPU work is bracketed in a host page "
                             "handed on with the cache (drain.py), so that a fenced successor need not wait for this "
                             "engine's exit once its queue is proven run")
    isolated_takeover: bool = Field(True, description="on CUDA, a fenced successor whose predecessor kept a drain mark "
                                    "adopts the journal once the predecessor's threads are exiting, while its queued "
                                    "GPU work may still run, writing none of what that work may write (isolation.py); "
                                    "false: it waits for the predecessor's queue to be proven run or for its exit")
    shadow: bool = Field(True, description="a prepared standby maps the engine the agent names (its weights and KV "
                         "cache) into its reservations before any failure (standby.py): the takeover maps nothing")
    rehearse: Literal["auto", "on", "off"] = Field(
        "auto", description="a prepared standby plays a takeover through once over scratch memory of its own before "
        "it shadows anyone (rehearsal.py): the kernels and code of a successor's first steps run before a failure, "
        "not on its path; auto: on CUDA (lazy kernel loading), not on the CPU")

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(0, description="HTTP port; 0: a free one (reported in the ready file and to the agent)")
    ready_file: Path | None = Field(None, description="written (JSON) once serving: endpoint, pid, timings")
    max_body_bytes: int = Field(64 << 20, gt=0, description="a request body over this is refused (413) by the front")
    header_timeout_s: float = Field(10.0, ge=0, description="a request's headers must be complete this long after "
                                    "its first byte, or the front closes the connection (0: no bound)")
    body_timeout_s: float = Field(30.0, ge=0, description="a request's body must be complete this long after its "
                                  "headers, or 408 (0: no bound)")
    log_level: str = "INFO"


    @model_validator(mode="after")
    def _degraded_alone(self) -> EngineConfig:
        if self.degrade_gang is not None:
            if self.role != "active":
                raise ValueError("a degraded successor (degrade_gang) is an active engine or group")
            if not self.transfer_token or self.gang_generation is None:
                raise ValueError("degrade_gang needs HF_TRANSFER_TOKEN and HF_GANG_GENERATION")
            if self.memory == "local":
                raise ValueError("degrade_gang takes leases over: it needs leased memory")
        if self.spare and (self.role != "standby" or self.memory == "local"):
            raise ValueError("a spare is a standby engine (or group) on leased memory")
        return self


def parse_config(argv: list[str]) -> EngineConfig:
    return CliApp.run(EngineConfig, cli_args=argv)
