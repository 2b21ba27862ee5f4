"""The engine's settings: flags (`--size tiny`) or environment (`HF_ENGINE_SIZE=tiny`).

The agent sets HF_ENGINE_ID, HF_ENGINE_ROLE, HF_MODEL, HF_AGENT_SOCKET (and, for a cold-spawned
successor, HF_TAKEOVER_FROM and HF_TRANSFER_TOKEN); they are read here too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, Field
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict


class TensorParallelSettings(BaseModel):
    """What a tensor-parallel engine of either kind reads (the agent sets HF_ENGINE_TP, and for a successor group
    HF_TAKEOVER_GANG + HF_GANG_GENERATION + HF_TRANSFER_TOKEN): one definition, so both engines answer the same names."""

    tp: int = Field(1, ge=1, le=64, description="tensor-parallel ranks: one process per rank (rank r on GPU gpu + r; "
                    "NCCL on CUDA, gloo on the CPU), weights sharded Megatron-style, the ranks' leases one gang "
                    "(docs/multi_gpu.md)")
    tp_one_gpu: bool = Field(False, description="every rank on GPU `gpu`, talking over gloo (NCCL refuses two ranks on "
                             "one GPU): a group's function on a one-GPU machine, not its speed")
    rank_gpus: list[int] = Field(default_factory=list, description="rank r's GPU, where the ranks' GPUs are not "
                                 "gpu..gpu+tp-1 (the agent sets HF_ENGINE_RANK_GPUS for a degraded group on the GPUs "
                                 "a failed one left)")
    tp_rank: int = Field(0, ge=0, description="set by rank 0 for the ranks it starts")
    tp_port: int = Field(0, ge=0, description="the ranks' rendezvous port on 127.0.0.1 (set by rank 0)")
    gang: str | None = Field(None, description="the gang id of this engine's ranks' leases (default: the engine id)")
    takeover_gang: str | None = Field(None, validation_alias=AliasChoices("takeover_gang", "HF_TAKEOVER_GANG"),
                                      description="a successor group: take this frozen gang over (with "
                                      "HF_TRANSFER_TOKEN and HF_GANG_GENERATION)")
    gang_generation: int | None = Field(None, validation_alias=AliasChoices("gang_generation", "HF_GANG_GENERATION"))


class EngineSettings(TensorParallelSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HF_ENGINE_", extra="ignore", cli_prog_name="holdfast engine serve",
                                      cli_kebab_case=True, cli_implicit_flags=True)

    size: str = Field("tiny", description="model size (engines/reference/config.py SIZES)")
    weights: Path = Field(description="safetensors file made by `make-weights`")
    id: str = Field(default_factory=lambda: f"ref-{os.getpid()}", description="engine id (the agent sets it)")
    role: Literal["active", "standby"] = Field("active", description="standby: warm up, then wait for an assignment")
    model: str = Field("reference", validation_alias=AliasChoices("model", "HF_MODEL"),
                       description="model name the router routes by")
    host: str = "127.0.0.1"
    port: int = Field(0, description="HTTP port; 0: a free one (reported in the ready file and to the agent)")
    device: str = Field("auto", description="auto (cuda when torch sees a GPU, else cpu), cpu, cuda, cuda:N")
    memory: Literal["auto", "leased", "local"] = Field(
        "auto", description="leased: Holdfast leases; local: plain tensors; auto: leased when a gpu_manager socket exists")
    gpu_manager_socket: str | None = Field(None, validation_alias=AliasChoices("gpu_manager_socket", "HF_GPU_MANAGER_SOCKET"),
                                           description="the gpu_manager's unix socket (default: <state_dir>/gpu_manager.sock)")
    gpu: int = Field(0, validation_alias=AliasChoices("gpu", "HF_GPU"))
    slots: int = Field(4, ge=1, description="concurrent requests (one KV slot each)")
    max_seq: int | None = Field(None, description="KV capacity per slot (default: the size's max_seq)")
    threads: int = Field(1, ge=1, description="torch CPU threads (fixed, so results do not depend on the machine's load)")
    prefill_chunk: int = Field(64, ge=1, description="prompt tokens per prefill forward (resumed tokens go one "
                               "at a time either way: engine.py invariant 1); predecessor and successor must agree")
    graphs: bool | None = Field(None, description="fixed-shape forwards (one token; a prompt's first chunk, padded) "
                                "replayed as CUDA graphs (engines/reference/static_forward.py); default: on CUDA only "
                                "(on a CPU they would only be slower); predecessor and successor must agree")
    ready_file: Path | None = Field(None, description="written (JSON) once serving: endpoint, pid, timings")
    takeover_from: str | None = Field(None, validation_alias=AliasChoices("takeover_from", "HF_TAKEOVER_FROM"))
    transfer_token: str | None = Field(None, validation_alias=AliasChoices("transfer_token", "HF_TRANSFER_TOKEN"))
    shadow: bool = Field(True, description="standby: shadow an active engine's weights when the agent offers it "
                         "(pre-built model, instant takeover); off: attach at the takeover")
    adopt_timeout_s: float = Field(30.0, gt=0, description="a promoted shadow waits this long for its predecessor's "
                                   "death to own its leases; then it exits with 75")
    kv_reuse_s: float = Field(10.0, ge=0, description="a promoted shadow reads its predecessor's KV cache for the "
                              "prefixes of resumed requests this long, then gives it back; an engine handed its "
                              "predecessor's KV lease (reattach, takeover) holds the slots of its requests this long "
                              "(engines/reference/kv_reuse.py); 0: neither")
    agent: Literal["auto", "on", "off"] = Field("auto", description="auto: link to the agent when HF_AGENT_SOCKET is set")
    log_level: str = "INFO"


def parse_engine_settings(argv: list[str]) -> EngineSettings:
    return CliApp.run(EngineSettings, cli_args=argv)
