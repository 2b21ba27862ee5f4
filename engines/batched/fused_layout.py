"""Fused projections without copying a leased weight: where the weights lease puts each tensor, and one view
over each layer's wq|wk|wv and w1|w3.

The loader writes the file's tensors into the weights lease in file order, except that each layer's q, k and v
projections are written back to back, and so are its gate (w1) and up (w3) projections. One view over such a
run is the fused projection (`attention.wqkv.weight` [q + k + v rows, dim], `feed_forward.w13.weight`
[2 * ffn, dim]): one GEMM where there were three (two), and nothing is copied at start-up, so a successor that
takes the lease over gets the same fused views from the registered offsets. Every tensor keeps its own name,
offset and registration: the reference engine, the checksum and the chaos checks see the file's tensors.

Invariant: a fused view is made only when its parts are, in the lease's own registration, contiguous, of one
dtype and back to back with no gap (`model_runner.check_fused` checks the pointers again). A lease laid out
otherwise (an older loader) gets no fused views and runs the parts one by one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

FUSED = {"attention.wqkv.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
         "feed_forward.w13.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight")}
_PART = {f"{part}": (fused, j) for fused, parts in FUSED.items() for j, part in enumerate(parts)}
_LAYER = re.compile(r"^(layers\.\d+\.)(.+)$")


def fused_group(name: str) -> tuple[str, int] | None:
    """(fused name, index within it) of a tensor that is part of a fused projection, else None."""
    m = _LAYER.match(name)
    if m is None or m.group(2) not in _PART:
        return None
    fused, j = _PART[m.group(2)]
    return m.group(1) + fused, j


def write_order(names_in_file_order: Iterable[str]) -> list[str]:
    """The order the loader writes the tensors in: file order, with each fused group's parts back to back (in the
    group's order) where its first part comes in the file."""
    names = list(names_in_file_order)
    first: dict[str, int] = {}
    for i, n in enumerate(names):
        g = fused_group(n)
        if g is not None:
            first.setdefault(g[0], i)

    def key(item: tuple[int, str]) -> tuple[int, int]:
        i, n = item
        g = fused_group(n)
        return (first[g[0]], g[1]) if g is not None else (i, -1)

    return [n for _, n in sorted(enumerate(names), key=key)]


@dataclass(frozen=True)
class Placed:
    """A registered tensor as the fused views need it."""

    name: str
    lease: object  # which lease (compared by identity)
    offset: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    contiguous: bool


def fused_runs(placed: Iterable[Placed]) -> dict[str, tuple[Placed, tuple[int, int]]]:
    """{fused name: (its first part, the fused view's shape)} for every group whose parts are complete and back
    to back in one lease with one dtype."""
    groups: dict[str, dict[int, Placed]] = {}
    for p in placed:
        g = fused_group(p.name)
        if g is not None:
            groups.setdefault(g[0], {})[g[1]] = p
    out: dict[str, tuple[Placed, tuple[int, int]]] = {}
    for fused, parts in groups.items():
        n = len(FUSED[fused.split(".", 2)[2]])
        if sorted(parts) != list(range(n)):
            continue
        run = [parts[j] for j in range(n)]
        a = run[0]
        ok = all(p.contiguous and len(p.shape) == 2 and p.lease is a.lease and p.dtype == a.dtype
                 and p.shape[1] == a.shape[1] for p in run)
        for prev, nxt in zip(run, run[1:], strict=False):
            ok = ok and nxt.offset == prev.offset + prev.shape[0] * prev.shape[1] * prev.itemsize
        if ok:
            out[fused] = (a, (sum(p.shape[0] for p in run), a.shape[1]))
    return out
