"""`holdfast bench restore --backend host|cuda --weights-gib N --dir D [--trials T] [--json]`: how fast a lease's
weights come back from each copy, side by side in one run, in GiB/s (p50 over trials; page cache dropped with
POSIX_FADV_DONTNEED before every timed read from disk, so the disk is measured, not memory).

In this process, with the gpu_manager's own backend (memfd or cuMemCreate chunks) and I/O code (blockio.py,
restore_cuda.py), without a stack:
- speed of light: direct reads of the artifact's files on `workers` threads into host memory (no hash, no
  copy on), and on cuda pinned host-to-device copies on 4 streams;
- `file`: the cold path as it is (safetensors_io._copy_in: preadv into the memfd on host, a 64 MiB pinned
  bounce buffer on cuda);
- `safetensors`: the peer a user would pick instead (safetensors.numpy / safetensors.torch load_file, to
  host memory or to the GPU); fastsafetensors is measured where installed;
- `artifact-buffered` and `artifact-direct`: the artifact restore without and with O_DIRECT, hashes checked;
- `host`: the host tier (the artifact's bytes in memfds, no hash); on cuda DMA'd from the memfds' own pages,
  registered in place once (`host_register_s`, apart), as the gpu_manager does (host_tier_cuda.py), and
  `host-bounce` beside it: the same memfds read on the pool through pinned bounce buffers (the fallback);
  on the host backend read on the pool straight into the lease's pages.
`--sources` times only some of them (the speed-of-light figures are always measured). Every restored lease is
compared with the weights file's bytes once, outside the timed region.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import typer

from services.gpu_manager import blockio
from services.gpu_manager.app import make_backend
from services.gpu_manager.artifact import file_names, plan_blocks
from services.gpu_manager.blockio import HostWindow, OpenFiles

SOURCES = ("file", "safetensors", "fastsafetensors", "artifact-buffered", "artifact-direct", "host", "host-bounce")

GIB = 1024**3
TENSOR_BYTES = 256 * 1024 * 1024
BLOCK = 64 * 1024 * 1024
FILE = 4 * GIB


def make_weights(path: Path, nbytes: int) -> None:
    """A safetensors file of `nbytes` in 256 MiB float16 tensors, each a different cheap pattern."""
    from safetensors.numpy import save_file

    tensors, left, i = {}, nbytes, 0
    while left > 0:
        n = min(TENSOR_BYTES, left)
        tensors[f"layer{i}.w"] = (np.arange(n // 2, dtype=np.uint16) * (i + 1)).view(np.float16)
        left -= n
        i += 1
    save_file(tensors, str(path))


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Bench:
    def __init__(self, backend: str, directory: Path, nbytes: int, workers: int) -> None:
        self.backend = make_backend(backend, [])
        self.gpu = 0
        gran = self.backend.granularity(0)
        self.dir = directory
        self.workers = workers
        self.path = directory / "weights.safetensors"
        from libs.client.safetensors_io import plan_layout, read_header

        make_weights(self.path, nbytes)
        self.data_start, header = read_header(self.path)
        self.layout, total = plan_layout(header, "bench")
        self.size = -(-max(total, BLOCK) // max(gran, 4096)) * max(gran, 4096)
        self.chunk = -(-GIB // gran) * gran

    # ---------------------------------------------------------------- leases

    def lease(self) -> list[Any]:
        from libs.client.protocol import chunk_sizes

        return self.backend.allocate(self.gpu, chunk_sizes(self.size, self.chunk), "bench")

    def window(self, chunks: list[Any], *, to_device: bool) -> Any:
        if self.backend.name == "cuda":
            from services.gpu_manager.restore_cuda import CudaWindow

            return CudaWindow(self.gpu, chunks, workers=self.workers, block_bytes=BLOCK, to_device=to_device)
        return HostWindow([c.fd for c in chunks], [c.size for c in chunks], read_only=not to_device)

    def mapping(self, chunks: list[Any]) -> Any:
        from libs.client.mapping import CudaMapping, HostMapping

        fds, sizes = [c.fd for c in chunks], [c.size for c in chunks]
        if self.backend.name == "cuda":
            return CudaMapping(fds, sizes, self.backend.gpu_uuid(self.gpu), self.gpu)
        return HostMapping(fds, sizes)

    def lease_bytes(self, chunks: list[Any]) -> np.ndarray:
        m = self.mapping(chunks)
        try:
            if m.kind == "cuda":
                return m.torch_bytes(0, self.size).cpu().numpy().copy()
            return np.frombuffer(m.buffer(0, self.size), dtype=np.uint8).copy()
        finally:
            m.unmap()

    # ---------------------------------------------------------------- sources

    def cold_file(self) -> tuple[float, list[Any]]:
        from libs.client.safetensors_io import _copy_in

        chunks = self.lease()
        m = self.mapping(chunks)
        drop_cache([self.path])
        fd = os.open(self.path, os.O_RDONLY)
        t0 = time.perf_counter()
        _copy_in(types.SimpleNamespace(mapping=m), fd, self.data_start, self.layout)  # type: ignore[arg-type]
        seconds = time.perf_counter() - t0
        os.close(fd)
        m.unmap()
        return seconds, chunks

    def peer_safetensors(self) -> float:
        drop_cache([self.path])
        t0 = time.perf_counter()
        if self.backend.name == "cuda":
            import safetensors.torch
            import torch

            out: object = safetensors.torch.load_file(str(self.path), device="cuda:0")
            torch.cuda.synchronize()
        else:
            import safetensors.numpy

            out = safetensors.numpy.load_file(str(self.path))
        seconds = time.perf_counter() - t0
        del out
        return seconds

    def peer_fastsafetensors(self) -> float | None:
        try:
            import fastsafetensors  # noqa: F401
        except ImportError:
            return None
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        drop_cache([self.path])
        t0 = time.perf_counter()
        loader = SafeTensorsFileLoader(SingleGroup(), "cuda:0" if self.backend.name == "cuda" else "cpu")
        loader.add_filenames({0: [str(self.path)]})
        fb = loader.copy_files_to_device()
        fb.close()
        loader.close()
        return time.perf_counter() - t0

    def write_artifact(self, chunks: list[Any]) -> tuple[list[Path], list[str], float]:
        entries = file_names(self.size, FILE)
        paths = [self.dir / e.name for e in entries]
        files = blockio.open_files(paths, write=True, direct=True, sizes=[e.bytes for e in entries])
        w = self.window(chunks, to_device=False)
        t0 = time.perf_counter()
        digests = blockio.write_blocks(files, plan_blocks(self.size, BLOCK, FILE), w, workers=self.workers)
        for fd in files.fds:
            os.fsync(fd)
        seconds = time.perf_counter() - t0
        files.close()
        w.close()
        return paths, digests, seconds

    def read(self, files: OpenFiles, digests: list[str] | None, *, into_device: bool) -> tuple[float, list[Any]]:
        """One restore: a new lease, filled from `files`. `into_device` False: host memfds (the disk's SOL)."""
        if into_device:
            chunks = self.lease()
            w = self.window(chunks, to_device=True)
        else:
            from libs.client.protocol import chunk_sizes
            from services.gpu_manager.backends import HostBackend

            chunks = HostBackend(capacity_bytes=1 << 62).allocate(0, chunk_sizes(self.size, self.chunk), "sol")
            w = HostWindow([c.fd for c in chunks], [c.size for c in chunks], read_only=False)
        seconds = blockio.read_blocks(files, plan_blocks(self.size, BLOCK, FILE), w, workers=self.workers, digests=digests,
                              what="bench")
        w.close()
        return seconds, chunks

    def read_registered(self, copy: Any) -> tuple[float, list[Any]]:
        """One host tier restore on cuda: DMA from the memfds' registered pages (host_tier_cuda.dma_blocks)."""
        from services.gpu_manager.host_tier_cuda import dma_blocks

        chunks = self.lease()
        w = self.window(chunks, to_device=True)
        try:
            return dma_blocks(w, copy, plan_blocks(self.size, BLOCK, FILE)), chunks
        finally:
            w.close()

    def free(self, chunks: list[Any]) -> None:
        self.backend.free(chunks)


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def parse_sources(text: str) -> tuple[str, ...]:
    """`--sources`: a comma-separated subset of SOURCES, or `all` (pure)."""
    if text.strip() == "all":
        return SOURCES
    picked = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in picked if x not in SOURCES]
    if unknown or not picked:
        raise ValueError(f"unknown sources {unknown or text!r}; known: all, {', '.join(SOURCES)}")
    return picked


def run(backend: str, weights_gib: float, directory: Path | None, trials: int, workers: int,
        sources: tuple[str, ...] = SOURCES) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="hf-bench-restore-", dir=directory))
    bench = Bench(backend, base, int(weights_gib * GIB), workers)
    gib = bench.size / GIB
    out: dict[str, Any] = {"backend": bench.backend.name, "gib": round(gib, 3), "workers": workers,
                           "trials": trials, "dir": str(base), "block_mib": BLOCK >> 20, "sources": list(sources),
                           "gib_s": {}, "seconds": {}}
    secs: dict[str, list[float]] = {}
    seconds, reference_chunks = bench.cold_file()
    reference = bench.lease_bytes(reference_chunks)
    paths, digests, write_s = bench.write_artifact(reference_chunks)
    out["artifact_write_gib_s"] = round(gib / write_s, 3)
    bench.free(reference_chunks)
    secs["file"] = [seconds]
    host_fds = HostWindowCopy.make(paths)
    registered = None
    cuda = bench.backend.name == "cuda"
    if cuda and "host" in sources:
        from services.gpu_manager.host_tier_cuda import RegisteredCopy

        registered = RegisteredCopy(host_fds, [e.bytes for e in file_names(bench.size, FILE)], bench.gpu)
        out["host_register_s"] = round(registered.register_s, 4)
        out["host_register_gib_s"] = round(gib / registered.register_s, 3)
    verified: dict[str, bool] = {}

    def timed(name: str, result: tuple[float, list[Any]]) -> None:
        s, c = result
        secs.setdefault(name, []).append(s)
        if name not in verified:
            verified[name] = bool(np.array_equal(bench.lease_bytes(c), reference))
        bench.free(c)

    for trial in range(trials):
        if trial and "file" in sources:
            s, c = bench.cold_file()
            secs["file"].append(s)
            bench.free(c)
        if "safetensors" in sources:
            secs.setdefault("safetensors", []).append(bench.peer_safetensors())
        fast = bench.peer_fastsafetensors() if "fastsafetensors" in sources else None
        if fast is not None:
            secs.setdefault("fastsafetensors", []).append(fast)
        drop_cache(paths)
        sol_files = blockio.open_files(paths, write=False, direct=True)
        s, c = bench.read(sol_files, None, into_device=False)
        sol_files.close()
        secs.setdefault("sol_direct_read", []).append(s)
        for x in c:  # host memfds, whatever the backend
            os.close(x.fd)
        for name, direct in (("artifact-buffered", False), ("artifact-direct", True)):
            if name not in sources:
                continue
            drop_cache(paths)
            files = blockio.open_files(paths, write=False, direct=direct)
            out.setdefault("direct_io", {})[name] = files.direct
            timed(name, bench.read(files, digests, into_device=True))
            files.close()
        if registered is not None:
            timed("host", bench.read_registered(registered))
        elif "host" in sources:
            timed("host", bench.read(OpenFiles(host_fds, direct=False, owned=False), None, into_device=True))
        if cuda and "host-bounce" in sources:
            timed("host-bounce", bench.read(OpenFiles(host_fds, direct=False, owned=False), None, into_device=True))
    if "host" in sources:
        out["host_path"] = "registered" if registered is not None else ("bounce" if cuda else "in place")
    if registered is not None:
        registered.close()
    if cuda:
        from services.gpu_manager.restore_cuda import pinned_h2d_gib_s

        out["gib_s"]["sol_pinned_h2d"] = round(pinned_h2d_gib_s(0, min(bench.size, 8 * GIB)), 3)
        for name in ("host", "host-bounce"):
            if name in secs:
                out.setdefault("share_of_pinned_h2d", {})[name] = round(
                    gib / p50(secs[name]) / out["gib_s"]["sol_pinned_h2d"], 3)
    if "file" not in sources:
        del secs["file"]  # the reference load, not a timed source here
    for name, xs in secs.items():
        out["seconds"][name] = round(p50(xs), 4)
        out["gib_s"][name] = round(gib / p50(xs), 3)
    out["verified"] = verified
    for fd in host_fds:
        os.close(fd)
    for p in [*paths, bench.path]:
        p.unlink()
    os.rmdir(base)
    return out


class HostWindowCopy:
    """The host tier as the gpu_manager keeps it: the artifact's files as memfds."""

    @staticmethod
    def make(paths: list[Path]) -> list[int]:
        fds = []
        for i, p in enumerate(paths):
            fd = os.memfd_create(f"bench-tier-{i}", os.MFD_CLOEXEC)
            with open(p, "rb") as f:
                while chunk := f.read(BLOCK):
                    os.write(fd, chunk)
            fds.append(fd)
        return fds


def cli(backend: str = typer.Option("auto", help="host, cuda or auto"),
        weights_gib: float = typer.Option(1.0, help="size of the weights"),
        dir: Path | None = typer.Option(None, help="where the weights file and the artifact go (the disk measured)"),
        trials: int = typer.Option(3, help="timed trials of each source (p50 reported)"),
        workers: int = typer.Option(0, help="blocks in flight (0: the cores, 2..16)"),
        sources: str = typer.Option("all", help=f"sources timed, comma-separated: all or some of {', '.join(SOURCES)}"),
        json_out: bool = typer.Option(False, "--json")) -> None:
    """GiB/s of the cold file load, safetensors, the artifact (buffered vs direct) and the host tier."""
    try:
        picked = parse_sources(sources)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--sources") from None
    result = run(backend, weights_gib, dir, trials, workers or blockio.default_workers(), picked)
    if json_out:
        print(json.dumps(result, indent=2))
        return
    print(f"restore {result['gib']} GiB on {result['backend']}, {result['workers']} workers, p50 of {trials} "
          f"trials, in {result['dir']} (artifact written at {result['artifact_write_gib_s']} GiB/s)")
    for name, rate in result["gib_s"].items():
        s = result["seconds"].get(name)
        print(f"  {name:20s} {rate:8.2f} GiB/s" + (f"  {s:.3f} s" if s is not None else ""))
    print(f"  restored bytes identical to the file: {result['verified']}")
