"""What both start-ups of the reference engine share (runner.py for one process, tp_runner.py for a
tensor-parallel group): the device, the memory (leased from the node's gpu_manager or local), the agent link, and
the first real forward that proves the memory serves."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engines.reference.engine import EngineCore, sample
from engines.reference.memory import LeasedMemory, LocalMemory
from engines.reference.settings import EngineSettings
from libs.common.events import RankProcess
from libs.common.tokenizer import BOS


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_manager_socket() -> Path:
    base = os.environ.get("HF_STATE_DIR") or str(Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"holdfast-{os.getuid()}")
    return Path(base) / "gpu_manager.sock"


def open_memory(s: EngineSettings, device: torch.device) -> LocalMemory | LeasedMemory:
    mode = s.memory
    if mode == "auto":
        sock = Path(s.gpu_manager_socket) if s.gpu_manager_socket else default_manager_socket()
        mode = "leased" if sock.exists() else "local"
    if mode == "local":
        return LocalMemory(device)
    return LeasedMemory(s.id, socket_path=s.gpu_manager_socket, engine_class=engine_class("reference"), gpu=s.gpu)


def engine_class(default: str) -> str:
    """The class this engine's leases are booked under: its spec's (the agent sets HF_ENGINE_CLASS), so that the
    node's copy of its weights is named as the dc_manager's placement looks for it (`<class>.weights`)."""
    return os.environ.get("HF_ENGINE_CLASS") or default


def open_agent_link(s: EngineSettings, *, can_shadow: bool = False, followers: Sequence[RankProcess] = ()) -> Any:
    """`followers`: a tensor-parallel group's rank 0 names its other ranks' processes (ranks.py `Followers`)."""
    if s.agent == "off" or (s.agent == "auto" and not os.environ.get("HF_AGENT_SOCKET")):
        return None
    from libs.client.agent_link import AgentLink

    link = AgentLink.connect(s.id, role=s.role, model=s.model, can_shadow=can_shadow, followers=followers)
    link.start_heartbeats(0.2)
    return link


def first_token(core: EngineCore) -> int:
    """One real forward over the (reattached) weights: proves the memory serves before ready is reported."""
    with core.spare_slot() as slot:  # not one holding a predecessor's request (kv_reuse.py invariant 5)
        tok = sample(core.forward(slot, [BOS], 0), 0.0, 0, 1)
    if core.model.device.type == "cuda":
        torch.cuda.synchronize(core.model.device)
    return tok
