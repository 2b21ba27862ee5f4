"""Load a safetensors file into one leased allocation: one lease for the whole file, every tensor registered
(name, offset, shape, dtype) and the layout committed, so a successor gets them back without reading disk.

The file's header is parsed here (8-byte little-endian length, then JSON); tensor bytes are read by many aligned
reads in flight (O_DIRECT where the filesystem takes it) and copied to their places in the lease: into its pages on
host, through pinned buffers on cuda (file_fill.py). Tensors are placed at 256-byte aligned offsets so every dtype
view is aligned.

`restore_or_load` is the one cold path of every engine (reference, batched): the node's copy of the class's
weights (host tier, else artifact, restored by the gpu_manager) when there is a sound one of the expected
layout, else the file. Invariants:
1. A copy is used only if its tensors are exactly the expected names and shapes; a refused copy's lease is
   released before the file is read (no second weights lease is left behind).
2. When a copy serves, nothing of the weights file is read (not even its header): a node can cold-start from
   its copy with the file gone.
3. A tensor-parallel rank's weights lease and its copy are named for its rank and group size (`shard_lease_name`,
   `copy_name(..., tp=, rank=)`): a rank never restores another rank's copy nor the whole model's, and a single
   engine never a rank's. (Ranks of one group have equal shapes, so the layout check of 1 cannot tell them apart:
   the name does; the shapes still refuse a whole model's or another group size's copy.)
"""

from __future__ import annotations

import json
import logging
import re
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.client.direct_io import default_workers
from libs.client.file_fill import fill_from_file
from libs.client.memory import MappedLease, MemoryClient
from libs.client.protocol import ArtifactInvalid, TensorMeta
from libs.common.errors import MalformedMessage, NotFound
from libs.common.procs import ms_since

log = logging.getLogger("holdfast.client.safetensors")

ALIGN = 256

SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
    "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
}


def read_header(path: str | Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data region, {name: {dtype, shape, data_offsets}}), without the __metadata__ entry."""
    data_start, header = read_full_header(path)
    header.pop("__metadata__", None)
    return data_start, header


def read_metadata(path: str | Path) -> dict[str, str]:
    """The header's __metadata__ (string keys and values; {} when there is none). Read from the header alone."""
    meta = read_full_header(path)[1].get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise MalformedMessage(f"{path}: __metadata__ is not a mapping")
    return meta


def read_full_header(path: str | Path) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise MalformedMessage(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise MalformedMessage(f"{path}: header of {n} bytes")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise MalformedMessage(f"{path}: the header is not a mapping")
    return 8 + n, header


def tensor_meta(name: str, entry: dict[str, Any], lease_id: str, offset: int) -> TensorMeta:
    """A header entry as the tensor registered at `offset` of a lease."""
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise MalformedMessage(f"tensor {name}: unsupported safetensors dtype {entry['dtype']}")
    return TensorMeta(name=name, lease_id=lease_id, offset=offset, shape=list(entry["shape"]), dtype=dtype)


Layout = list[tuple[TensorMeta, int, int]]  # (meta at its lease offset, file offset in the data region, bytes)
Planner = Callable[[dict[str, Any], str], tuple[Layout, int]]


def plan_layout(header: dict[str, Any], lease_id: str, order: Sequence[str] | None = None) -> tuple[Layout, int]:
    """[(meta, file offset, nbytes)] at aligned lease offsets, in `order` (default: the file's), and the total
    bytes needed."""
    out, offset = [], 0
    for name in order or sorted(header, key=lambda n: header[n]["data_offsets"][0]):
        start, end = header[name]["data_offsets"]
        out.append((tensor_meta(name, header[name], lease_id, offset), start, end - start))
        offset += -(-(end - start) // ALIGN) * ALIGN
    return out, max(offset, ALIGN)


def fill_lease(mapping: Any, path: str | Path, data_start: int, layout: Layout, *,
               workers: int | None = None) -> bool:
    """The layout's tensors read from the file into the mapped lease (file_fill.py: parallel aligned reads, O_DIRECT
    where the filesystem takes it, pieces copied to their lease offsets); returns whether the reads were direct."""
    ranges = [(data_start + start, meta.offset, nbytes) for meta, start, nbytes in layout]
    return fill_from_file(mapping, path, ranges, workers=workers or default_workers())


def load_safetensors_into_leases(client: MemoryClient, path: str | Path, *, tag: str = "weights",
                                 name: str = "weights", gpu: int = 0, framework: str = "torch") -> dict[str, Any]:
    """Allocate one lease for the file, fill it, register and commit every tensor; return the views."""
    lease, metas = load_file_into_lease(client, path, tag=tag, name=name, gpu=gpu)
    return {m.name: lease.view(m, framework) for m in metas}


Filler = Callable[[MappedLease, Layout], None]


def load_file_into_lease(client: MemoryClient, path: str | Path, *, tag: str = "weights", name: str = "weights",
                         gpu: int = 0, plan: Planner = plan_layout, expected: Mapping[str, Sequence[int]] | None = None,
                         fill: Filler | None = None) -> tuple[MappedLease, list[TensorMeta]]:
    """The file into one lease, its tensors registered and committed: the lease and its tensors. `plan` places
    the tensors in the lease; `expected` (names -> shapes): the file must hold exactly those. `fill` writes the
    tensors' values into the lease (default: read from the file; a header-only file whose values are drawn at
    load, engines/reference/weights.py, passes its own)."""
    data_start, header = read_header(path)
    if expected is not None:
        why = layout_mismatch({n: e["shape"] for n, e in header.items()}, expected)
        if why:
            raise WeightsMismatch(f"{path}: {why}")
    _, total = plan(header, "pending")
    lease = client.allocate(total, tag=tag, name=name, gpu=gpu)
    layout, _ = plan(header, lease.id)
    if fill is None:
        fill_lease(lease.mapping, path, data_start, layout)
    else:
        fill(lease, layout)
    metas = [meta for meta, _, _ in layout]
    client.register(metas)
    client.commit()
    return lease, metas


class WeightsMismatch(ValueError):
    """The weights file does not hold the tensors (names, shapes) the engine expects."""


def layout_mismatch(shapes: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]]) -> str | None:
    """Why weights of these tensor shapes are not the expected ones (None: they are). Pure."""
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    wrong = sorted(n for n in set(expected) & set(shapes) if list(shapes[n]) != list(expected[n]))
    parts = [f"{len(missing)} tensors missing (e.g. {missing[0]})" if missing else "",
             f"{len(extra)} unexpected (e.g. {extra[0]})" if extra else "",
             f"{len(wrong)} of another shape (e.g. {wrong[0]}: {list(shapes[wrong[0]])}, "
             f"expected {list(expected[wrong[0]])})" if wrong else ""]
    return "; ".join(p for p in parts if p) or None


def shard_lease_name(lease_name: str, tp: int, rank: int) -> str:
    """The name of rank `rank`'s lease of `lease_name` in a group of `tp` ranks (`weights.tp2-r1`); tp 1: unchanged.
    The gpu_manager names a lease's copy after the lease (`copy_name`), so each rank's copy is its own."""
    if tp <= 1:
        return lease_name
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of a group of {tp}")
    return f"{lease_name}.tp{tp}-r{rank}"


def copy_name(engine_class: str, lease_name: str = "weights", *, tp: int = 1, rank: int = 0) -> str:
    """The node copy a class's weights lease is kept under, `<class>.<lease name>` made a valid artifact name (the
    one rule: the gpu_manager writes its copies under it, artifact.default_name, and an engine asks for it); a
    tensor-parallel rank's under its rank's lease name (invariant 3)."""
    raw = f"{engine_class}.{shard_lease_name(lease_name or 'weights', tp, rank)}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw).lstrip("._-")[:200] or "weights"


@dataclass
class WeightsLoad:
    """One cold load: the tensors' views, the lease and its tensors, which source served ("host", "artifact"
    or "file"), how long it took, the gpu_manager's restore figures, and why a copy was not used ("" if none
    was refused or none existed)."""

    tensors: dict[str, Any]
    lease: MappedLease
    metas: list[TensorMeta]
    source: str
    load_ms: float
    restore: dict[str, Any] = field(default_factory=dict)
    refused: str = ""

    def report(self) -> dict[str, Any]:
        """What an engine tells about its load (its /health, its ready message to the agent)."""
        out: dict[str, Any] = {"source": self.source, "load_ms": self.load_ms}
        if self.refused:
            out["refused"] = self.refused
        if self.restore:
            out["restore"] = {k: v for k, v in self.restore.items() if k != "source"}
        return out


def restore_or_load(client: MemoryClient, path: str | Path, *, copy: str | None,
                    expected: Mapping[str, Sequence[int]] | None = None, plan: Planner = plan_layout,
                    tag: str = "weights", name: str = "weights", gpu: int = 0, framework: str = "torch",
                    load_file: Callable[[], tuple[MappedLease, list[TensorMeta]]] | None = None,
                    filler: Callable[[], Filler | None] | None = None) -> WeightsLoad:
    """The cold path (invariants 1, 2 above): the node's copy `copy` (host tier, else artifact) if there is a
    sound one whose tensors are `expected` (names -> shapes), else the file laid out by `plan` and written by what
    `filler` gives (asked only then: a copy that serves never touches the file, which may be gone; None or its
    None: the file's bytes), or `load_file` (a tensor-parallel rank's part of the file, in a lease registered and
    committed) when given."""
    t0 = time.perf_counter()
    refused = ""
    if copy is not None:
        try:
            lease = client.restore(copy, gpu=gpu)
        except (NotFound, ArtifactInvalid) as e:
            refused = "" if isinstance(e, NotFound) else f"{e.code}: {e.message}"
            log.log(logging.WARNING if refused else logging.INFO, "no sound copy %s (%s: %s): loading %s", copy,
                    e.code, e.message, path)
        else:
            metas = list(lease.tensor_metas)
            why = None if expected is None else layout_mismatch({m.name: m.shape for m in metas}, expected)
            if why is None:
                client.commit()
                return WeightsLoad({m.name: lease.view(m, framework) for m in metas}, lease, metas,
                                   str(client.last_restore["source"]), ms_since(t0), dict(client.last_restore))
            refused = f"layout: {why}"
            log.warning("copy %s refused (%s): releasing it, loading %s", copy, why, path)
            client.release(lease.id)
    if load_file is not None:
        lease, metas = load_file()
    else:
        lease, metas = load_file_into_lease(client, path, tag=tag, name=name, gpu=gpu, plan=plan, expected=expected,
                                            fill=filler() if filler is not None else None)
    return WeightsLoad({m.name: lease.view(m, framework) for m in metas}, lease, metas, "file", ms_since(t0),
                       refused=refused)


def load_weights(client: MemoryClient, path: str | Path, *, artifact: str | None = None, tag: str = "weights",
                 name: str = "weights", gpu: int = 0, framework: str = "torch") -> tuple[dict[str, Any], str]:
    """`restore_or_load` with no layout check: (tensor views, the source that served)."""
    got = restore_or_load(client, path, copy=artifact, tag=tag, name=name, gpu=gpu, framework=framework)
    return got.tensors, got.source

