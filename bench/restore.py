"""`holdfast bench restore --backend host|cuda --weights-gib N --dir D [--trials T] [--json]`: how fast a lease's
weights come back from each copy, side by side in one run, in GiB/s (p50 over trials; page cache dropped with
POSIX_FADV_DONTNEED before every timed read from disk, so the disk is measured, not memory).

In this process, with the gpu_manager's own backend (memfd or cuMemCreate chunks) and I/O code (blockio.py,
restore_cuda.py), without a stack:
- speed of light: direct reads of the artifact's files on `workers` threads into host memory (no hash, no
  copy on), and on cuda pinned host-to-device copies on 4 streams;
- `file`: the engines' cold path as it is (safetensors_io.fill_lease: aligned reads of the weights file on
  `workers` threads, O_DIRECT where allowed, each into a buffer of its own, then to the lease: into the memfd's
  pages on host, through pinned buffers on cuda);
- `safetensors`: the peer a user would pick instead (safetensors.numpy / safetensors.torch load_file, to
  host memory or to the GPU); fastsafetensors is measured where installed;
- `artifact-buffered` and `artifact-direct`: the artifact restore without and with O_DIRECT, hashes checked;
- `host`: the host tier (the lease's bytes in memfds of the artifact's file sizes, written from the lease as the
  gpu_manager writes its tier; read with no hash); on cuda DMA'd from the memfds' own pages, registered in place
  right after the copy is written (`host_registered_at`: write; `host_register_s` apart, and in `host_write_s`),
  as the gpu_manager does (host_tier_cuda.py), and `host-bounce` beside it: the same memfds read on the pool
  through pinned bounce buffers (the fallback); on the host backend read on the pool straight into the lease's
  pages. `to_ready_s`: each restore from nothing on the device (a new lease allocated and mapped) to the lease
  filled and ready (every copy complete, the manager's mapping gone), beside its fill alone in `seconds`.
`--sources` (or `--from`; `artifact` is artifact-direct) times only some of them (the speed-of-light figures are
always measured). Every restored lease is compared with the weights file's bytes once, outside the timed region (on
cuda on the device: a reference copy of the file's lease is kept there).
A host-tier-only run (`--from host[,host-bounce] --no-first-token`: nothing reads a file) writes no weights file
and no artifact: the weights are made in a lease on the device (bench/restore_synth.py) and every restore is
checked against that pattern a slice at a time, so the run needs one copy of the weights in RAM (the tier's) and
one lease on the device; `--weights-gib 0` then takes the largest that fits (`host_only_room` says what bounds
it); `sol_direct_read` is skipped (no artifact).
`--first-token` (the CLI's default): then a new batched engine's time from process start to its first token from
the file, the artifact and the host tier, each as the engine reports it served (bench/first_token.py): its weights
file is then the model's, read by the lease fills too (written once), and `side_by_side` puts each source's lease
fill beside its engine's load and first token.
The report says what it could not measure: `errors` (a source that failed, with its exception; the others go on),
`skipped` (a peer library not installed, host-bounce on the host backend), `error` and `complete: false` (a run
that failed before any source); `peers` (which libraries are there), `goals` (issue 21's shares and ratios, and
the 120 GiB host-tier restore extrapolated from this run's rate) and `steps` (when each finished). `--out` is
rewritten after every step, so a run cut off by a time limit still leaves what it measured.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import typer

from bench import restore_synth
from bench.stats import quantile
from devstack.pagecache import drop_cache
from libs.client import direct_io
from libs.client.direct_io import OpenFiles
from services.gpu_manager import blockio
from services.gpu_manager.app import make_backend
from services.gpu_manager.artifact import file_names, plan_blocks
from services.gpu_manager.blockio import HostWindow

GDS_NODE = "/dev/nvidia-fs0"  # GPUDirect Storage's device: fastsafetensors reads disk to GPU with it
SOURCES = ("file", "safetensors", "fastsafetensors", "artifact-buffered", "artifact-direct", "host", "host-bounce")
FILE_SOURCES = ("file", "safetensors", "fastsafetensors", "artifact-buffered", "artifact-direct")  # read the file
ALIASES = {"artifact": "artifact-direct"}  # the issue's `--from host,artifact,file`: the restore path as it runs
GOAL_SHARE = 0.8  # issue 21: host tier >= 80% of pinned H2D, artifact >= 80% of the disk's direct reads
TARGET_GIB, TARGET_S = 120, 5.0  # issue 21: the 120 GiB fallback under 5 s where a host copy exists

GIB = 1024**3
TENSOR_BYTES = 256 * 1024 * 1024
BLOCK = 64 * 1024 * 1024
FILE = 4 * GIB


def tensor_sizes(nbytes: int) -> list[int]:
    """The file's tensors: 256 MiB each, the last the rest (even: float16) (pure)."""
    sizes, left = [], nbytes - nbytes % 2
    while left > 0:
        sizes.append(min(TENSOR_BYTES, left))
        left -= sizes[-1]
    return sizes


def make_weights(path: Path, nbytes: int) -> None:
    """A safetensors file of `nbytes` in float16 tensors, each a different cheap pattern, written one tensor at a
    time (the format's header, then the data): memory of one tensor, not of the whole file (16 GiB and more)."""
    sizes = tensor_sizes(nbytes)
    header, at = {}, 0
    for i, n in enumerate(sizes):
        header[f"layer{i}.w"] = {"dtype": "F16", "shape": [n // 2], "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data region 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, n in enumerate(sizes):
            f.write((np.arange(n // 2, dtype=np.uint16) * (i + 1)).tobytes())


class Bench:
    """`synthetic`: no weights file; `generate` makes the weights in a lease (bench/restore_synth.py), `nbytes` 0:
    the largest this machine holds (`room`)."""

    def __init__(self, backend: str, directory: Path, nbytes: int, workers: int,
                 weights: Callable[[str], Path] | None = None, *, synthetic: bool = False) -> None:
        self.backend = make_backend(backend, [])
        self.gpu = 0
        gran = self.backend.granularity(0)
        self.dir = directory
        self.workers = workers
        self.synthetic = synthetic
        self.path = directory / "weights.safetensors"
        self.room: dict[str, Any] | None = None
        if synthetic:
            self.room = restore_synth.host_only_room(self.backend, self.gpu)
            total = nbytes if nbytes > 0 else self.room["max_bytes"] - self.room["max_bytes"] % GIB
            if total > self.room["max_bytes"]:
                raise ValueError(f"{total / GIB:.2f} GiB does not fit here: at most {self.room['max_gib']} GiB "
                                 f"(bound by {self.room['bound']} memory: {self.room})")
        else:
            from libs.client.safetensors_io import plan_layout, read_header

            if nbytes <= 0:
                raise ValueError("--weights-gib 0 (the largest that fits) is for a host-tier-only run "
                                 "(--from host[,host-bounce] --no-first-token)")
            if weights is None:
                make_weights(self.path, nbytes)
            else:  # the file `weights(backend)` gives (the first-token part's model, written once for both parts)
                self.path = weights(self.backend.name)
            self.data_start, header = read_header(self.path)
            self.layout, total = plan_layout(header, "bench")
        self.size = -(-max(total, BLOCK) // max(gran, 4096)) * max(gran, 4096)
        self.chunk = -(-GIB // gran) * gran
        self.file_direct = False  # the file path's reads were O_DIRECT (the last `cold_file`)
        self.host_fds: list[int] = []  # the host tier's memfds, once copied
        self.registered: Any = None  # their registration on cuda (host_tier_cuda.RegisteredCopy)

    def close(self) -> None:
        if self.registered is not None:
            self.registered.close()
            self.registered = None
        for fd in self.host_fds:
            os.close(fd)
        self.host_fds = []
        if self.backend.name == "cuda" and "torch" in sys.modules:
            sys.modules["torch"].cuda.empty_cache()  # the reference copy's device memory, for what runs next

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

    def lease_bytes(self, chunks: list[Any]) -> Any:
        """A copy of the lease's bytes, on cuda kept on the device: read back to numpy, 16 GiB took ~25 s on the
        H200, once for the reference and again for every source checked."""
        m = self.mapping(chunks)
        try:
            if m.kind == "cuda":
                import torch

                copy = m.torch_bytes(0, self.size).clone()
                torch.cuda.synchronize()  # the clone is done before the pages are unmapped
                return copy
            return np.frombuffer(m.buffer(0, self.size), dtype=np.uint8).copy()
        finally:
            m.unmap()

    def generate(self) -> list[Any]:
        """A new lease holding the synthetic weights (restore_synth.pattern), written where it is."""
        chunks = self.lease()
        m = self.mapping(chunks)
        try:
            restore_synth.fill(m, self.size)
        finally:
            m.unmap()
        return chunks

    def same_bytes(self, chunks: list[Any], reference: Any) -> bool:
        """Whether the lease holds `reference`'s bytes (lease_bytes), compared where they are; `reference` None: the
        synthetic weights, checked a slice at a time."""
        m = self.mapping(chunks)
        try:
            if reference is None:
                return restore_synth.matches(m, self.size)
            if m.kind == "cuda":
                import torch

                return bool(torch.equal(m.torch_bytes(0, self.size), reference))  # a bool: synchronized
            return bool(np.array_equal(np.frombuffer(m.buffer(0, self.size), dtype=np.uint8), reference))
        finally:
            m.unmap()

    # ---------------------------------------------------------------- sources

    def cold_file(self) -> tuple[float, list[Any]]:
        from libs.client.safetensors_io import fill_lease

        chunks = self.lease()
        m = self.mapping(chunks)
        drop_cache([self.path])
        t0 = time.perf_counter()
        self.file_direct = fill_lease(m, self.path, self.data_start, self.layout, workers=self.workers)
        seconds = time.perf_counter() - t0
        m.unmap()
        return seconds, chunks

    def file_bytes_match(self, chunks: list[Any], edge: int = 64 * 1024) -> bool:
        """Whether the lease filled by `cold_file` holds each tensor's first and last `edge` bytes as the file
        has them (read here with plain buffered preads: a check of the reads' plan independent of it)."""
        m = self.mapping(chunks)
        try:
            with open(self.path, "rb") as f:
                for meta, start, nbytes in self.layout:
                    for at in sorted({0, max(0, nbytes - edge)}):
                        n = min(edge, nbytes - at)
                        want = os.pread(f.fileno(), n, self.data_start + start + at)
                        if m.kind == "cuda":
                            got = m.torch_bytes(meta.offset + at, n).cpu().numpy().tobytes()
                        else:
                            got = bytes(m.buffer(meta.offset + at, n))
                        if got != want:
                            return False
            return True
        finally:
            m.unmap()

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

    def peer_fastsafetensors(self) -> float:
        """fastsafetensors' loader, the whole file to the GPU (or host memory), GDS where the machine has it
        (/dev/nvidia-fs0), else its own fallback (`nogds`: threads of preads into pinned bounce buffers)."""
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        drop_cache([self.path])
        t0 = time.perf_counter()
        loader = SafeTensorsFileLoader(SingleGroup(), "cuda:0" if self.backend.name == "cuda" else "cpu",
                                       nogds=not Path(GDS_NODE).exists())
        loader.add_filenames({0: [str(self.path)]})
        fb = loader.copy_files_to_device()
        if self.backend.name == "cuda":
            import torch

            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        fb.close()
        loader.close()
        return seconds

    def write_artifact(self, chunks: list[Any]) -> tuple[list[Path], list[str], float]:
        entries = file_names(self.size, FILE)
        paths = [self.dir / e.name for e in entries]
        files = direct_io.open_files(paths, write=True, direct=True, sizes=[e.bytes for e in entries])
        w = self.window(chunks, to_device=False)
        t0 = time.perf_counter()
        digests = blockio.write_blocks(files, plan_blocks(self.size, BLOCK, FILE), w, workers=self.workers)
        for fd in files.fds:
            os.fsync(fd)
        seconds = time.perf_counter() - t0
        files.close()
        w.close()
        return paths, digests, seconds

    def copy_to_tier(self, chunks: list[Any]) -> float:
        """The host tier as the gpu_manager writes it (restore.py `_write_tier`): memfds of the artifact's file sizes
        in `host_fds`, written from the lease block by block on the pool; its seconds."""
        for i, e in enumerate(file_names(self.size, FILE)):
            self.host_fds.append(os.memfd_create(f"bench-tier-{i}", os.MFD_CLOEXEC))
            os.ftruncate(self.host_fds[-1], e.bytes)
        w = self.window(chunks, to_device=False)
        t0 = time.perf_counter()
        try:
            blockio.write_blocks(OpenFiles(self.host_fds, direct=False, owned=False), plan_blocks(self.size, BLOCK, FILE),
                                 w, workers=self.workers)
        finally:
            w.close()
        return time.perf_counter() - t0

    def read(self, files: OpenFiles, digests: list[str] | None, *, into_device: bool) -> tuple[float, list[Any], float]:
        """One restore: a new lease, filled from `files`: (the fill's seconds, the lease, seconds from nothing to the
        lease ready). `into_device` False: host memfds (the disk's SOL)."""
        t0 = time.perf_counter()
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
        return seconds, chunks, time.perf_counter() - t0

    def sol_read(self, paths: list[Path]) -> float:
        """The disk's speed of light: O_DIRECT reads on the pool into host memory, no hash, no copy on."""
        drop_cache(paths)
        files = direct_io.open_files(paths, write=False, direct=True)
        try:
            seconds, chunks, _ = self.read(files, None, into_device=False)
        finally:
            files.close()
        for x in chunks:  # host memfds, whatever the backend
            os.close(x.fd)
        return seconds

    def read_registered(self, copy: Any) -> tuple[float, list[Any], float]:
        """One host tier restore on cuda: DMA from the memfds' registered pages (host_tier_cuda.dma_blocks), as `read`:
        (the DMA's seconds, the lease, seconds from nothing on the device to the lease ready)."""
        from services.gpu_manager.host_tier_cuda import dma_blocks

        t0 = time.perf_counter()
        chunks = self.lease()
        w = self.window(chunks, to_device=True)
        try:
            seconds = dma_blocks(w, copy, plan_blocks(self.size, BLOCK, FILE))
        finally:
            w.close()
        return seconds, chunks, time.perf_counter() - t0

    def free(self, chunks: list[Any]) -> None:
        self.backend.free(chunks)


def p50(xs: list[float]) -> float:
    return quantile(xs, 50)


def parse_sources(text: str) -> tuple[str, ...]:
    """`--sources` / `--from`: a comma-separated subset of SOURCES (or ALIASES), or `all` (pure)."""
    if text.strip() == "all":
        return SOURCES
    picked = tuple(dict.fromkeys(ALIASES.get(x.strip(), x.strip()) for x in text.split(",") if x.strip()))
    unknown = [x for x in picked if x not in SOURCES]
    if unknown or not picked:
        raise ValueError(f"unknown sources {unknown or text!r}; known: all, {', '.join([*SOURCES, *ALIASES])}")
    return picked


def peer_status() -> dict[str, Any]:
    """Whether each peer library can run here, and what it is: a missing one is said in the report, not skipped
    silently."""
    out: dict[str, Any] = {}
    for name in ("safetensors", "fastsafetensors"):
        try:
            mod = __import__(name)
            out[name] = {"installed": True, "version": getattr(mod, "__version__", "?")}
        except ImportError as e:
            out[name] = {"installed": False, "why": str(e)}
    out["fastsafetensors"]["gds"] = Path(GDS_NODE).exists()
    return out


def goals(out: dict[str, Any]) -> dict[str, Any]:
    """Issue 21's goals from a report's figures (pure): each share or ratio, and whether it is met. A figure not
    measured (its source not asked for, failed, or not on this backend) is left out."""
    rate, g = out["gib_s"], {}
    sol_h2d, sol_disk = rate.get("sol_pinned_h2d"), rate.get("sol_direct_read")
    if sol_h2d and rate.get("host"):
        g["host_share_of_pinned_h2d"] = {"share": round(rate["host"] / sol_h2d, 3), "goal": GOAL_SHARE,
                                         "met": rate["host"] / sol_h2d >= GOAL_SHARE}
    if sol_disk and rate.get("artifact-direct"):
        g["artifact_share_of_direct_read"] = {"share": round(rate["artifact-direct"] / sol_disk, 3),
                                              "goal": GOAL_SHARE, "met": rate["artifact-direct"] / sol_disk >= GOAL_SHARE}
    if rate.get("fastsafetensors"):
        for name in ("artifact-direct", "host", "file"):
            if rate.get(name):
                g[f"{name}_vs_fastsafetensors"] = {"speedup": round(rate[name] / rate["fastsafetensors"], 3),
                                                   "met": rate[name] > rate["fastsafetensors"]}
                trials = out.get("trials_s", {})
                ours, theirs = trials.get(name, []), trials.get("fastsafetensors", [])
                if ours and len(ours) == len(theirs):  # each trial's pair, run back to back
                    g[f"{name}_vs_fastsafetensors"]["per_trial"] = [round(t / o, 3) for o, t in zip(ours, theirs, strict=True)]
    if rate.get("host"):
        # The weights' copy alone, at this run's host-tier rate; the new engine's start is on top (cold_starts).
        s = TARGET_GIB / rate["host"]
        g["host_120gib_extrapolated"] = {"restore_s": round(s, 2), "from_gib": out["gib"], "goal_s": TARGET_S,
                                         "met": s < TARGET_S}
        ready = out.get("to_ready_s", {}).get("host")
        if ready:  # nothing on the device to the lease ready (allocate, map, fill), scaled in proportion: its
            # fixed costs scaled too, so this errs long
            r = ready * TARGET_GIB / out["gib"]
            g["host_120gib_extrapolated"].update(to_ready_s=round(r, 2), to_ready_met=r < TARGET_S)
        through = out.get("manager", {}).get("to_ready_s", {}).get("p50")
        if through:  # the same through the gpu_manager and the SDK, as an engine's cold start gets it
            r = through * TARGET_GIB / out["gib"]
            g["host_120gib_extrapolated"].update(manager_to_ready_s=round(r, 2), manager_to_ready_met=r < TARGET_S)
    return g


def run(backend: str, weights_gib: float, directory: Path | None, trials: int, workers: int,
        sources: tuple[str, ...] = SOURCES, progress: Callable[[dict[str, Any]], None] | None = None,
        first_token: bool = False, manager: bool = False) -> dict[str, Any]:
    """The report. `progress(report)` is called after every step (the report so far: a run cut off still leaves its
    figures); a source that fails is in `errors` and the others go on; a failure before any source could run (the
    file, the reference load, the artifact) ends the run with `error` set. With `first_token`, then a new engine's
    time to its first token from each source (bench/first_token.py), once the lease fills' files are gone. With
    `manager` (a host-tier-only run), then the host tier restore through a real gpu_manager (bench/restore_manager.py),
    once this part's tier copy is gone."""
    if first_token and "file" not in sources:  # the engines' baseline, beside its lease fill (the reference load)
        sources = ("file", *sources)
    synthetic = not first_token and not any(s in FILE_SOURCES for s in sources)  # nothing reads a file
    base = Path(tempfile.mkdtemp(prefix="hf-bench-restore-", dir=directory))
    out: dict[str, Any] = {"backend": backend, "workers": workers, "trials": trials, "dir": str(base),
                           "block_mib": BLOCK >> 20, "sources": list(sources), "peers": peer_status(), "gib_s": {},
                           "seconds": {}, "to_ready_s": {}, "verified": {}, "errors": {}, "skipped": {}, "steps": [],
                           "direct_io": {},
                           "complete": False, "weights": "generated in a lease" if synthetic else "file"}
    step = stepper(out, progress)
    bench: Bench | None = None
    model: Callable[[str], Path] | None = None
    if first_token:
        from bench import first_token as ft

        model = lambda name: ft.model_file(name, weights_gib, base / ft.WORK)  # noqa: E731
    try:
        bench = Bench(backend, base, int(weights_gib * GIB), workers, model, synthetic=synthetic)
        out["backend"], out["gib"] = bench.backend.name, round(bench.size / GIB, 3)
        if bench.room is not None:
            out["host_only_room"] = bench.room
        step("weights generated in a lease" if synthetic else "weights file written")
        if manager and not synthetic:
            raise ValueError("--manager is for a host-tier-only run (--from host[,host-bounce] --no-first-token)")
        _measure(bench, out, sources, trials, step)
        out["goals"] = goals(out)
        if manager:
            from bench import restore_manager

            bench.close()  # one copy of the weights in RAM at a time
            restore_manager.run(out, out["backend"], bench.size, trials, step)
            out["goals"] = goals(out)
        if first_token:
            bench.close()
            clear(base, keep=ft.WORK)  # the disk then holds the model and one copy at a time, not this artifact too
            ft.run(out, out["backend"], weights_gib, base / ft.WORK, trials, sources, step)
        out["complete"] = True
    except Exception as e:  # noqa: BLE001 - said in the report, which is printed either way
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        step("done")
        if bench is not None:
            bench.close()
        shutil.rmtree(base, ignore_errors=True)
    return out


def _measure(bench: Bench, out: dict[str, Any], sources: tuple[str, ...], trials: int,
             step: Callable[[str], None]) -> None:
    gib, cuda = bench.size / GIB, bench.backend.name == "cuda"
    secs: dict[str, list[float]] = {}
    readies: dict[str, list[float]] = {}
    if cuda:
        from services.gpu_manager.restore_cuda import pinned_h2d_gib_s

        out["gib_s"]["sol_pinned_h2d"] = round(pinned_h2d_gib_s(0, min(bench.size, 8 * GIB)), 3)
        step("pinned host-to-device")
    paths: list[Path] = []
    digests: list[str] = []
    if bench.synthetic:  # no file, no artifact: checked against the pattern, no reference copy
        t0 = time.perf_counter()
        reference_chunks, reference = bench.generate(), None
        out["generate_s"] = round(time.perf_counter() - t0, 3)
        step("weights made in a lease")
    else:
        seconds, reference_chunks = bench.cold_file()
        reference = bench.lease_bytes(reference_chunks)
        out["verified"]["file"] = bench.file_bytes_match(reference_chunks)
        if "file" in sources:
            secs["file"] = [seconds]
            out["seconds"]["file"], out["gib_s"]["file"] = round(seconds, 4), round(gib / seconds, 3)
        step("reference load (file)")
        paths, digests, write_s = bench.write_artifact(reference_chunks)
        out["artifact_write_gib_s"] = round(gib / write_s, 3)
        step("artifact written")
    copy_s = bench.copy_to_tier(reference_chunks)
    out["host_copy_gib_s"], out["host_write_s"] = round(gib / copy_s, 3), round(copy_s, 4)
    bench.free(reference_chunks)
    registered = register_at_write(bench, out) if cuda and "host" in sources else None
    step("host tier copied")

    def timed(name: str, fn: Callable[[], Any]) -> None:
        """One trial of a source: its seconds, its bytes checked once (restores), a failure in `errors`."""
        if name in out["errors"]:
            return  # failed once: not again
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - one source failing leaves the others' figures
            out["errors"][name] = f"{type(e).__name__}: {e}"
            step(f"{name} failed")
            return
        s, chunks, ready = (*got, None)[:3] if isinstance(got, tuple) else (got, None, None)  # ready: restores only
        secs.setdefault(name, []).append(s)
        if ready is not None:
            readies.setdefault(name, []).append(ready)
            out["to_ready_s"][name] = round(p50(readies[name]), 4)
        if chunks is not None:
            if name not in out["verified"]:
                out["verified"][name] = bench.same_bytes(chunks, reference)
            bench.free(chunks)
        out["seconds"][name], out["gib_s"][name] = round(p50(secs[name]), 4), round(gib / p50(secs[name]), 3)
        step(name)

    def host(path: str) -> Callable[[], tuple[float, list[Any], float]]:
        if path == "registered":
            return lambda: bench.read_registered(registered)
        return lambda: bench.read(OpenFiles(bench.host_fds, direct=False, owned=False), None, into_device=True)

    def artifact(direct: bool) -> Callable[[], tuple[float, list[Any], float]]:
        def restore() -> tuple[float, list[Any], float]:
            drop_cache(paths)
            files = direct_io.open_files(paths, write=False, direct=direct)
            out["direct_io"][f"artifact-{'direct' if direct else 'buffered'}"] = files.direct
            try:
                return bench.read(files, digests, into_device=True)
            finally:
                files.close()
        return restore

    for peer in ("safetensors", "fastsafetensors"):
        if peer in sources and not out["peers"][peer]["installed"]:  # said, and not a failure of the run
            out["skipped"][peer] = f"not installed: {out['peers'][peer]['why']}"
            sources = tuple(x for x in sources if x != peer)
    if not cuda and "host-bounce" in sources:
        out["skipped"]["host-bounce"] = "cuda only: on the host backend the tier is read straight into the lease"
    if not paths:
        out["skipped"]["sol_direct_read"] = "no artifact: a host-tier-only run writes none"
    for trial in range(trials):
        # The file's readers take turns going first (every other trial in reverse), so that none is always the
        # one that runs right after the artifact's or the tier's work.
        readers = [(name, fn) for name, fn in (("file", bench.cold_file), ("safetensors", bench.peer_safetensors),
                                               ("fastsafetensors", bench.peer_fastsafetensors))
                   if name in sources and (trial or name != "file")]  # trial 0's file load is the reference's
        for name, fn in readers[::-1] if trial % 2 else readers:
            timed(name, fn)
        if paths:
            timed("sol_direct_read", lambda: bench.sol_read(paths))
        if "artifact-buffered" in sources:
            timed("artifact-buffered", artifact(False))
        if "artifact-direct" in sources:
            timed("artifact-direct", artifact(True))
        if "host" in sources:
            timed("host", host("registered" if registered is not None else "bounce"))
        if cuda and "host-bounce" in sources:
            timed("host-bounce", host("bounce"))
    out["trials_s"] = {name: [round(x, 4) for x in xs] for name, xs in secs.items()}
    out["direct_io"]["file"] = bench.file_direct
    if "host" in sources:
        out["host_path"] = "registered" if registered is not None else ("bounce" if cuda else "in place")
    if cuda:
        for name in ("host", "host-bounce"):
            if name in out["gib_s"]:
                out.setdefault("share_of_pinned_h2d", {})[name] = round(
                    out["gib_s"][name] / out["gib_s"]["sol_pinned_h2d"], 3)


def register_at_write(bench: Bench, out: dict[str, Any]) -> Any:
    """The tier's copy page-locked in place right after its write, as the gpu_manager does (restore.py `snapshot`),
    so no restore pays for it; None where it is refused (then the bounce buffers, as in the manager)."""
    from services.gpu_manager.host_tier_cuda import RegisteredCopy

    try:
        registered = RegisteredCopy(bench.host_fds, [e.bytes for e in file_names(bench.size, FILE)], bench.gpu)
    except Exception as e:  # noqa: BLE001 - said in the report; the host tier then goes through the bounce buffers
        out["errors"]["host_register"] = f"{type(e).__name__}: {e}"
        out["host_registered_at"] = None
        return None
    bench.registered = registered
    out["host_registered_at"] = "write"
    out["host_register_s"] = round(registered.register_s, 4)
    out["host_register_gib_s"] = round(bench.size / GIB / registered.register_s, 3)
    out["host_write_s"] = round(out["host_write_s"] + registered.register_s, 4)  # the copy and its registering
    return registered


def clear(directory: Path, keep: str) -> None:
    for p in directory.iterdir():
        if p.name != keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def stepper(out: dict[str, Any], progress: Callable[[dict[str, Any]], None] | None) -> Callable[[str], None]:
    """`step(name)`: a step done, at seconds since now, added to `out["steps"]`, then `progress(out)`."""
    t_run = time.perf_counter()

    def step(name: str) -> None:
        out["steps"].append([name, round(time.perf_counter() - t_run, 2)])
        if progress is not None:
            progress(out)
    return step


def reporter(label: str, out_path: Path | None) -> Callable[[dict[str, Any]], None]:
    """A bench's `progress`: each step on stderr (stdout is the report alone) and the report so far to `out_path`."""
    def progress(report: dict[str, Any]) -> None:
        print(f"{label}: {report['steps'][-1][0]} at {report['steps'][-1][1]} s", file=sys.stderr, flush=True)
        if out_path is not None:
            write_report(out_path, report)
    return progress


def write_report(path: Path, report: dict[str, Any]) -> None:
    """The report so far, replaced whole (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def cli(backend: str = typer.Option("auto", help="host, cuda or auto"),
        weights_gib: float = typer.Option(1.0, min=0.0, help="size of the weights (0: the largest that fits, in a "
                                                    "host-tier-only run: --from host[,host-bounce] --no-first-token)"),
        dir: Path | None = typer.Option(None, help="where the weights file and the artifact go (the disk measured)"),
        trials: int = typer.Option(3, min=1, help="timed trials of each source (p50 reported)"),
        workers: int = typer.Option(0, min=0, max=256, help="blocks in flight (0: the cores, 2..16)"),
        sources: str = typer.Option("all", "--sources", "--from",
                                    help=f"sources timed, comma-separated: all or some of {', '.join(SOURCES)} "
                                         "(artifact: artifact-direct)"),
        first_token: bool = typer.Option(True, "--first-token/--no-first-token",
                                         help="then a new batched engine's time to its first token from the file, "
                                              "the artifact and the host tier (those asked for; the file always)"),
        manager: bool = typer.Option(False, "--manager/--no-manager",
                                     help="host-tier-only runs: then the host tier restore through a real "
                                          "gpu_manager (a cold-starting engine's path), p50 over the trials"),
        out_path: Path | None = typer.Option(None, "--out", help="the JSON report, rewritten after every step"),
        json_out: bool = typer.Option(False, "--json")) -> None:
    """GiB/s of the cold file load, safetensors, fastsafetensors, the artifact (buffered vs direct) and the host
    tier, beside the machine's speeds of light, then a new engine's time to its first token from each source; exits 1
    when the run failed or a source did."""
    try:
        picked = parse_sources(sources)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--sources") from None
    if not math.isfinite(weights_gib):
        raise typer.BadParameter(f"{weights_gib} is not a size", param_hint="--weights-gib")

    result = run(backend, weights_gib, dir, trials, workers or direct_io.default_workers(), picked,
                 reporter("bench restore", out_path), first_token, manager)
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        print(f"restore {result.get('gib')} GiB on {result['backend']}, {result['workers']} workers, p50 of {trials} "
              f"trials, in {result['dir']} " + (f"(artifact written at {result.get('artifact_write_gib_s')} GiB/s)"
                                                 if result["weights"] == "file" else "(weights made in a lease, no file)"))
        for name, rate in result["gib_s"].items():
            s, ready = result["seconds"].get(name), result["to_ready_s"].get(name)
            print(f"  {name:20s} {rate:8.2f} GiB/s" + (f"  {s:.3f} s" if s is not None else "")
                  + (f"  (nothing on the device to the lease ready: {ready:.3f} s)" if ready is not None else ""))
        if "host_registered_at" in result:
            print(f"  host tier copy registered at: {result['host_registered_at']} "
                  f"({result.get('host_register_s')} s; the copy and its registering {result.get('host_write_s')} s)")
        if "host_only_room" in result:
            print(f"  a host-tier-only run here holds at most {result['host_only_room']['max_gib']} GiB of weights "
                  f"(bound by {result['host_only_room']['bound']} memory)")
        print(f"  restored bytes identical to the weights: {result['verified']}")
        for name, row in result.get("side_by_side", {}).items():
            print(f"  new engine from {name:8s} ready {row['to_ready_s']} s, first token {row['to_first_token_s']} s "
                  f"(its load {row['engine_load_ms']} ms; lease fill {row['fill_s']} s)")
        m = result.get("manager", {})
        if "to_ready_s" in m:
            print(f"  through the gpu_manager: nothing on the device to the lease ready {m['to_ready_s']['p50']} s "
                  f"(fill {m['fill_s']['p50']} s, registering at restore {m['register_s']['p50']} s; the copy "
                  f"{'registered' if m['registered_at_write'] else 'not registered'} at its write, {m['write_s']} s; "
                  f"health answered within {m['health_max_ms']} ms meanwhile, {m['health_timeouts']} polls unanswered)")
        for name, why in result["errors"].items():
            print(f"  {name}: FAILED {why}")
        if "error" in result:
            print(f"  run FAILED: {result['error']}")
    if "error" in result or result["errors"]:
        raise typer.Exit(1)
