"""The weights file: made once from a seeded initialization, loaded by a cold start.

Determinism: each tensor draws from its own generator seeded by (seed, crc32(name)), so the bytes of the
file depend only on (size, seed, dtype, the generator's device type) and not on the order tensors are made in.

A *drawn* file (`make-weights --drawn`) is the header alone, its metadata saying so: a load draws each tensor's
values where it lands (a lease on the GPU: the GPU's generator), the same values a full file drawn on that device
type holds, byte for byte. It stands for weights larger than the machine's disk and RAM can hold as a file (a
120 GiB model on a machine of 125 GiB RAM and 64 GiB disk): benchmarks only, as any seeded file is.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engines.reference.config import ModelConfig
from libs.client.safetensors_io import SAFETENSORS_DTYPES, read_full_header, read_metadata

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def _init_tensor(n_layers: int, name: str, shape: tuple[int, ...], seed: int,
                 device: str = "cpu") -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float32, device=device)
    gen = torch.Generator(device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if name == "tok_embeddings.weight":
        std = 1.0
    else:
        std = 1.0 / math.sqrt(shape[1])  # fan-in scaling keeps activations O(1) through the layers
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            std /= math.sqrt(2 * n_layers)  # residual branches: the sum over layers stays O(1)
        if name == "output.weight":
            std *= 4.0  # peaked next-token distributions, so greedy and sampled text differ visibly
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=device).mul_(std)  # one buffer, not two


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def make_weights(cfg: ModelConfig, out: Path, *, seed: int = 0, dtype: str | None = None,
                 device: str = "cpu", drawn: bool = False) -> Path:
    """Write the safetensors file for `cfg` (deterministic for a given size, seed and dtype), one tensor at a
    time, so memory stays at one tensor whatever the model's size: safetensors' `save_file` builds the whole
    file in memory first, and a 32 GiB model did not get written on a 125 GiB machine. The format is the
    library's (an 8-byte little-endian header length, a JSON header with each tensor's dtype, shape and byte
    range, padded to 8 bytes, then the bytes); its reader (`load_file`, `safe_open`) reads it back.

    `device`: where the values are drawn. One CPU generator draws ~100 M values/s (a 120 GiB file: ~10 minutes,
    more than a device call); a GPU's, thousands of times that, so the file's write is what is left. The two
    draw different values from one seed: the bytes depend on (size, seed, dtype, device type), recorded.

    `drawn`: the header alone; a load draws the values on its own device (module docstring)."""
    dt = torch_dtype(dtype or cfg.dtype)
    item = torch.empty((), dtype=dt).element_size()
    shapes = cfg.tensor_shapes()
    names = sorted(shapes)
    header: dict[str, object] = {}
    offset = 0
    for name in names:
        nbytes = math.prod(shapes[name]) * item
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dt], "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    # One metadata key, the header's keys sorted: the file must be the same bytes each time.
    header["__metadata__"] = {"holdfast": json.dumps({"size": cfg.name, "seed": seed,
                                                      "dtype": str(dt).removeprefix("torch."),
                                                      **({"drawn": "at load"} if drawn else
                                                         {"drawn_on": "cuda"} if device != "cpu" else {}),
                                                      "config": cfg.__dict__}, sort_keys=True)}
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names if not drawn else ():
            t = _init_tensor(cfg.n_layers, name, shapes[name], seed, device).to(dt).contiguous().cpu()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        # on the disk before it is used: the rename is durable only then, and a 13 GiB file left to the kernel's
        # writeback (~30 s later) stalled etcd's fsyncs on the same disk by 100-200 ms mid-benchmark (H200, 2026-12-03)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(out)  # a reader never sees half a file
    return out


def file_metadata(path: Path) -> dict[str, Any]:
    """The holdfast entry of the file's metadata ({} for a file made elsewhere). From the header alone, so that a
    drawn file (header only) reads too."""
    raw = read_metadata(path).get("holdfast")
    return json.loads(raw) if raw else {}


@dataclass(frozen=True)
class _Recipe:
    """A drawn file's header: how each tensor's values are made (`_init_tensor`) and the dtype they are stored in."""

    seed: int
    layers: int
    header: dict[str, Any]  # name -> {dtype, shape, data_offsets}

    def values(self, name: str, device_type: str) -> torch.Tensor:
        """`name`'s values in float32, drawn by a generator of `device_type`."""
        return _init_tensor(self.layers, name, tuple(self.header[name]["shape"]), self.seed, device_type)

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(SAFETENSORS_DTYPES[self.header[name]["dtype"]])


def _recipe(path: Path) -> _Recipe | None:
    """The recipe of a drawn file, from one read of its header; None for a file that holds its values."""
    _, header = read_full_header(path)
    meta = header.pop("__metadata__", None)
    raw = meta.get("holdfast") if isinstance(meta, dict) else None
    info = json.loads(raw) if raw else {}
    if info.get("drawn") != "at load":
        return None
    return _Recipe(int(info["seed"]), int(info["config"]["n_layers"]), header)


def is_drawn(path: Path) -> bool:
    """Whether the file is the header alone, its values drawn at load."""
    return _recipe(path) is not None


def lease_filler(path: Path) -> Callable[[Any, list[Any]], None] | None:
    """How a cold load writes this file's values into its lease (libs/client/safetensors_io.py
    `load_file_into_lease`'s `fill`): None (its bytes, read), or, for a drawn file, each tensor's values drawn on
    the lease's device and written at its place, one tensor's draw in memory at a time. It reads the file's
    header: ask it only once the file is to be loaded (restore_or_load's `filler`), not when a copy of the weights
    serves and the file may be gone."""
    recipe = _recipe(path)
    if recipe is None:
        return None

    def fill(lease: Any, layout: list[Any]) -> None:
        devices = set()
        for meta, _, _ in layout:
            view = lease.view(meta, "torch")
            view.copy_(recipe.values(meta.name, view.device.type))
            devices.add(view.device)
        for dev in devices:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the values are in the lease before it is committed
                torch.cuda.empty_cache()  # the draws' buffers (GBs for an embedding): the KV cache is leased next

    return fill


def check_file_matches(path: Path, cfg: ModelConfig) -> None:
    size = file_metadata(path).get("size")
    if size is not None and size != cfg.name:
        raise ValueError(f"{path} holds size {size!r}, the engine is configured for {cfg.name!r}")


def load_weights(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A cold start's read of the file into ordinary (not leased) tensors (a drawn file's: drawn on `device`)."""
    recipe = _recipe(path)
    if recipe is None:
        return load_file(str(path), device=str(device))
    dev = torch.device(device)
    return {name: recipe.values(name, dev.type).to(dev, recipe.dtype(name)) for name in recipe.header}


def weights_sha256(tensors: dict[str, torch.Tensor], *, chunk_bytes: int = 1 << 28) -> str:
    """A fingerprint of every tensor's raw bytes in name order, computed where the tensors are (hashing
    16 GiB through the CPU would take longer than the recovery it checks): each chunk of 256 MiB is reduced
    on its device to two exact integer sums, plain and position-weighted, and those go through sha256.
    Integer sums are exact, so the result is the same for a weights file on the CPU and leased tensors on a
    GPU; any changed byte changes a sum (the check that weights really survived)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        flat = tensors[name].detach().contiguous().view(torch.uint8).reshape(-1)
        h.update(f"{name}:{flat.numel()};".encode())
        for chunk in flat.split(chunk_bytes):
            words = chunk.to(torch.int64)
            weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64) % 65521
            h.update(f"{int(words.sum())},{int((words * weights).sum())};".encode())
    return h.hexdigest()


def checksum_body(engine_id: str, weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """An engine's /checksum body: the sha256 of the weights it serves (seconds for a large model: call it off any
    loop or step thread)."""
    return {"engine_id": engine_id, "weights_sha256": weights_sha256(weights)}


async def served_checksum(engine_id: str, weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """`checksum_body` hashed on a thread, for an engine that serves HTTP on its own loop."""
    import asyncio

    return await asyncio.to_thread(checksum_body, engine_id, weights)
