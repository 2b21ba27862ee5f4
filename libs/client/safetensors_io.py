"""Load a safetensors file into one leased allocation: one lease for the whole file, every tensor registered
(name, offset, shape, dtype) and the layout committed, so a successor gets them back without reading disk.

The file's header is parsed here (8-byte little-endian length, then JSON); tensor bytes are read straight
into the mapped lease on host (preadv into the shared pages) and through a bounce buffer on cuda. Tensors
are placed at 256-byte aligned offsets so every dtype view is aligned.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

from libs.client.memory import MappedLease, MemoryClient
from libs.client.protocol import ArtifactInvalid, TensorMeta
from libs.common.errors import MalformedMessage, NotFound

log = logging.getLogger("holdfast.client.safetensors")

ALIGN = 256
BOUNCE_BYTES = 64 * 1024 * 1024

SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
    "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
}


def read_header(path: str | Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data region, {name: {dtype, shape, data_offsets}}), without the __metadata__ entry."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise MalformedMessage(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise MalformedMessage(f"{path}: header of {n} bytes")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def plan_layout(header: dict[str, Any], lease_id: str) -> tuple[list[tuple[TensorMeta, int, int]], int]:
    """[(meta, file offset, nbytes)] at aligned lease offsets, and the total bytes needed."""
    out, offset = [], 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise MalformedMessage(f"tensor {name}: unsupported safetensors dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        meta = TensorMeta(name=name, lease_id=lease_id, offset=offset, shape=list(entry["shape"]), dtype=dtype)
        out.append((meta, start, end - start))
        offset += -(-(end - start) // ALIGN) * ALIGN
    return out, max(offset, ALIGN)


def _copy_in(lease: MappedLease, fd: int, data_start: int, layout: list[tuple[TensorMeta, int, int]]) -> None:
    if lease.mapping.kind == "host":
        for meta, start, nbytes in layout:
            if nbytes:
                view = memoryview(lease.mapping.buffer(meta.offset, nbytes)).cast("B")
                done = 0
                while done < nbytes:
                    got = os.preadv(fd, [view[done:]], data_start + start + done)
                    if got <= 0:
                        raise MalformedMessage("safetensors file is shorter than its header says")
                    done += got
        return
    import torch

    bounce = torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True)
    for meta, start, nbytes in layout:
        for pos in range(0, nbytes, BOUNCE_BYTES):
            n = min(BOUNCE_BYTES, nbytes - pos)
            chunk = bounce[:n]
            if os.preadv(fd, [chunk.numpy().data], data_start + start + pos) != n:
                raise MalformedMessage("safetensors file is shorter than its header says")
            lease.mapping.torch_bytes(meta.offset + pos, n).copy_(chunk)
    torch.cuda.synchronize()


def load_safetensors_into_leases(client: MemoryClient, path: str | Path, *, tag: str = "weights",
                                 name: str = "weights", gpu: int = 0, framework: str = "torch") -> dict[str, Any]:
    """Allocate one lease for the file, fill it, register and commit every tensor; return the views."""
    data_start, header = read_header(path)
    _, total = plan_layout(header, "pending")
    lease = client.allocate(total, tag=tag, name=name, gpu=gpu)
    layout, _ = plan_layout(header, lease.id)
    fd = os.open(path, os.O_RDONLY)
    try:
        _copy_in(lease, fd, data_start, layout)
    finally:
        os.close(fd)
    metas = [meta for meta, _, _ in layout]
    client.register(metas)
    client.commit()
    return {m.name: lease.view(m, framework) for m in metas}


def load_weights(client: MemoryClient, path: str | Path, *, artifact: str | None = None, tag: str = "weights",
                 name: str = "weights", gpu: int = 0, framework: str = "torch") -> tuple[dict[str, Any], str]:
    """The cold path: restore from this node's copy of `artifact` (host tier, else the artifact on disk) when
    there is a sound one, else read the safetensors file. Returns (tensor views, the source that served:
    "host", "artifact" or "file"). A missing, truncated or corrupt copy is logged and the file is read."""
    if artifact is not None:
        try:
            lease = client.restore(artifact, gpu=gpu)
        except (NotFound, ArtifactInvalid) as e:
            log.warning("no sound copy of %s (%s: %s): loading %s", artifact, e.code, e.message, path)
        else:
            client.commit()
            return {m.name: lease.view(m, framework) for m in lease.tensor_metas}, str(client.last_restore["source"])
    return load_safetensors_into_leases(client, path, tag=tag, name=name, gpu=gpu, framework=framework), "file"
