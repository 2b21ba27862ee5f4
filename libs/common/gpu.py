"""Is there a usable NVIDIA GPU here? (cuda-python's driver API; no torch.) And a node's GPUs by index or UUID."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

from libs.common.errors import NotFound


@functools.cache
def gpu_count() -> int:
    if os.environ.get("HF_FORCE_NO_GPU"):
        return 0
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]

        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return 0
        err, count = driver.cuDeviceGetCount()
        return int(count) if int(err) == 0 else 0
    except Exception:  # noqa: BLE001 - no cuda-python or no driver: no GPU
        return 0


def has_gpu() -> bool:
    return gpu_count() > 0


# ---------------------------------------------------------------- a node's GPUs, named by index or UUID (pure)


@dataclass(frozen=True)
class GpuEntry:
    """One GPU of a node: its node-local index (what leases and etcd keys use) and its UUID (what stays the same
    across reboots and CUDA_VISIBLE_DEVICES orders, so what specs should name)."""

    index: int
    uuid: str
    total_bytes: int | None = None
    simulated: bool = False


def parse_links(pairs: Sequence[str], indexes: Sequence[int]) -> dict[int, frozenset[int]]:
    """GPU index -> the GPUs it reaches over NVLink, from pairs "a-b" (both ways). Raises ValueError on a pair that
    is malformed, joins a GPU to itself, or names a GPU not in `indexes`."""
    out: dict[int, set[int]] = {}
    for pair in pairs:
        a, sep, b = str(pair).strip().partition("-")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit() or int(a) == int(b):
            raise ValueError(f"GPU link {pair!r} is not two GPU indexes 'a-b'")
        for x in (int(a), int(b)):
            if x not in indexes:
                raise ValueError(f"GPU link {pair!r} names GPU {x}, not one of {sorted(indexes)}")
        out.setdefault(int(a), set()).add(int(b))
        out.setdefault(int(b), set()).add(int(a))
    return {i: frozenset(peers) for i, peers in out.items()}


def simulated_uuid(node: str, index: int) -> str:
    """The UUID of the host backend's stand-in GPU `index`: the same in the agent and the gpu_manager of a node."""
    return f"SIM-{node}-{index}"


def simulated_gpus(selectors: Sequence[int | str], node: str, total_bytes: int | None = None) -> list[GpuEntry]:
    """The host backend's GPUs from config: an index ("1") is that GPU with a made-up UUID; a UUID is the GPU at its
    position in the list. Empty: one GPU, 0 (the host's memory as one pool). Raises ValueError on a duplicate."""
    out: dict[int, GpuEntry] = {}
    for pos, sel in enumerate(selectors or [0]):
        text = str(sel).strip()
        index = int(text) if text.isdigit() else pos
        uuid = simulated_uuid(node, index) if text.isdigit() else text
        if index in out or any(e.uuid == uuid for e in out.values()):
            raise ValueError(f"GPU {text!r} is listed twice (as index {index})")
        out[index] = GpuEntry(index, uuid, total_bytes, simulated=True)
    return [out[i] for i in sorted(out)]


def resolve_gpu(selector: int | str, gpus: Sequence[GpuEntry]) -> GpuEntry:
    """The GPU a spec or command names: by UUID (exact, or the unique entry it is a prefix of, as nvidia-smi
    accepts), or by index (an int or a string of digits). Raises NotFound for a GPU this node does not have."""
    text = str(selector).strip()
    if text.isdigit() and not text.startswith("GPU-"):
        hit = [g for g in gpus if g.index == int(text)]
    else:
        hit = [g for g in gpus if g.uuid == text] or [g for g in gpus if len(text) >= 8 and g.uuid.startswith(text)]
    if len(hit) != 1:
        have = ", ".join(f"{g.index}={g.uuid}" for g in gpus) or "none"
        raise NotFound(f"no GPU {text!r} on this node (it has {have})")
    return hit[0]
