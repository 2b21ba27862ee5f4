"""Where the batched engine's tensors come from: the only module of this engine that talks to the memory SDK.

- `LocalMemory`: plain tensors (standalone runs, tests without a gpu_manager); nothing survives the process.
- `LeasedMemory`: weights in `weights` leases, the paged KV cache and its journal in one `kv_cache` lease.
  `load` (cold, from the file), `attach` (this engine's own leases after a restart), `takeover` (a dead
  predecessor's leases: a cold-spawned successor or a promoted standby). A handed-on KV lease whose journal
  was written for this configuration is kept as it is: its sequences continue (journal.py).
  `take_backups` (a degraded successor: a broken gang's every rank's KV backup) and `take_backup` (a group
  regrouping a single engine: its KV backup alone) hand rank 0 backups only; the caller loads the weights cold and
  restores from them (degrade.py).
  `reserve` (a warm standby, before any failure): the addresses where a takeover will map the predecessor's
  weights and KV leases (their sizes and the weights' placement computed as `load` computes them: from the file's
  header and this configuration), backed by placeholder memory, and the same tensors as `takeover` will give, over
  them: a runner built and its graphs captured over these stays valid after the takeover when `placed_alike`.

Invariant: the engine never sees the SDK, only `Loaded`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engines.batched.cache_units import block_elements, kv_shape
from engines.batched.config import EngineConfig
from engines.batched.drain import DRAIN_NAME, PageLayout, Pending, await_fence, pending
from engines.batched.fused_layout import FUSED, Placed, fused_runs, write_order
from engines.batched.journal import Journal, JournalLayout
from engines.batched.kv_backup import BACKUP_NAME
from engines.reference.config import ModelConfig, get_config
from engines.reference.memory import retry_until
from engines.reference.tp import shard_config
from engines.reference.weights import check_file_matches, lease_filler, load_weights
from libs.client.protocol import contiguous_stride
from libs.common.procs import ms_since

log = logging.getLogger("holdfast.engine.batched.memory")

KV_NAME = "kv_cache"
ALIGN = 256


class MissingWeights(ValueError):
    """The leases handed to this engine do not hold a complete set of the model's weights."""


class NotBackupsAlone(RuntimeError):
    """A takeover meant to hand this engine a KV backup alone (frozen `backups_only`) handed it other leases."""


@dataclass
class Loaded:
    weights: dict[str, torch.Tensor]
    kv: torch.Tensor  # [units, 2, num_blocks, block_size, kv heads a unit, head_dim] (cache_units.py)
    journal: dict[str, torch.Tensor]
    source: str  # "file", "reattached", "takeover", "backup" (a cold load, or a spare's, beside a handed-on KV
    # backup), "degraded", "spare" (a spare's weights, loaded before its assignment, beside a new cache)
    kv_handed_on: bool  # the KV lease (and its journal) came from before: its sequences may continue
    layout: JournalLayout
    timings_ms: dict[str, float] = field(default_factory=dict)
    fused: dict[str, torch.Tensor] = field(default_factory=dict)  # views over back-to-back parts (fused_layout.py)
    weights_load: dict[str, Any] | None = None  # a cold load's source (host, artifact, file) and time (WeightsLoad)
    backup: dict[str, torch.Tensor] | None = None  # a handed-on KV backup lease's tensors (backup.py), if any
    fence: list[Any] = field(default_factory=list)  # a fenced takeover's predecessors (FencePid) to see exit first
    drain: torch.Tensor | None = None  # a handed-on drain mark's page (drain.py), if the predecessor kept one
    degraded: Any = None  # a broken gang's every rank's backup (degrade.py `Degraded`), for a degraded successor
    placed: tuple[Any, ...] | None = None  # a standby's weights reservation: where its tensors lie (`placement`)


@dataclass
class Spare:
    """A spare's memory before its assignment (`LeasedMemory.load_spare`): its weights' load and its own KV cache."""

    got: Any  # the weights' load (libs/client/safetensors_io.py `WeightsLoad`): lease, metas, source, time
    layout: JournalLayout
    kv: torch.Tensor
    journal: dict[str, torch.Tensor]
    kv_lease: str  # the cache's lease id (released if a backup of another block count comes)
    load_ms: float


def placement(ptr: int, metas: Sequence[Any]) -> tuple[Any, ...]:
    """Where a weights lease's tensors lie, as one comparable value: its base address and every tensor's name,
    offset, shape, dtype and strides (the lease id left out: a reservation's metas name none)."""
    from libs.client.protocol import contiguous_stride

    return (ptr, tuple(sorted((m.name, m.offset, tuple(m.shape), m.dtype,
                               tuple(m.stride if m.stride is not None else contiguous_stride(list(m.shape))))
                              for m in metas)))


def _tensors(lease: Any) -> dict[str, torch.Tensor]:
    """Every tensor a lease registered, by name."""
    return {m.name: lease.view(m, "torch") for m in lease.tensor_metas}


def backups_alone(leases: list[Any]) -> bool:
    """Leases handed on are KV backups (backup.py) and nothing else: what a predecessor frozen `backups_only` hands."""
    return bool(leases) and all(any(m.name == BACKUP_NAME for m in lease.tensor_metas) for lease in leases)


def _degraded(leases: list[Any], t0: float, granted: dict[str, Any]) -> Any:
    """Backup leases taken over as degrade.py's `Degraded` (which rank's each is: its name), to be given back once
    restored (`lease_ids`)."""
    from engines.batched.degrade import gathered

    d = gathered({lease.info.name: _tensors(lease) for lease in leases})
    d.lease_ids, d.timings_ms = [lease.id for lease in leases], {"takeover_ms": ms_since(t0), **granted}
    return d


def kv_layout(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, *, block_size: int, max_num_seqs: int,
              max_len: int, num_blocks: int | None, kv_cache_gib: float | None,
              peers: Sequence[ModelConfig] = ()) -> JournalLayout:
    """The cache's size: given blocks, or given GiB, or (CUDA) 85% of the memory free now, or (CPU) room for
    every sequence at the full length. `peers`: every rank's share of a tensor-parallel group; GiB and free memory
    are then counted in the largest rank's blocks, so that every rank makes as many (tp.py's cyclic placement keeps
    the ranks within one head of a layer)."""
    elements = max(block_elements(c, block_size) for c in (cfg, *peers))
    per_block = elements * torch.empty((), dtype=dtype).element_size()
    if num_blocks is None and kv_cache_gib is not None:
        num_blocks = int(kv_cache_gib * 2**30) // per_block
    if num_blocks is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        num_blocks = int(free * 0.85) // per_block
    if num_blocks is None:
        num_blocks = max_num_seqs * -(-max_len // block_size)
    return JournalLayout(block_size=block_size, num_blocks=max(2, num_blocks), slots=max_num_seqs, max_len=max_len)


def _packed(cfg: ModelConfig, dtype: torch.dtype, layout: JournalLayout) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    """(name, dtype, shape, byte offset) of the cache and the journal's tensors in one KV lease."""
    items = [(KV_NAME, dtype, kv_shape(cfg, layout.num_blocks, layout.block_size))]
    items += [(n, dt, shape) for n, (dt, shape) in layout.tensors().items()]
    out, off = [], 0
    for name, dt, shape in items:
        out.append((name, dt, shape, off))
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        off = -(-(off + nbytes) // ALIGN) * ALIGN
    return out


def lease_bytes(cfg: ModelConfig, dtype: torch.dtype, layout: JournalLayout) -> int:
    name, dt, shape, off = _packed(cfg, dtype, layout)[-1]
    return off + torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()


class LocalMemory:
    kind = "local"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pending(self) -> bool:
        return False

    def load(self, cfg: ModelConfig, path: Path, layout_of: Any) -> Loaded:
        check_file_matches(path, cfg)
        return self.load_shard(cfg, lambda: load_weights(path, self.device), layout_of)

    def load_shard(self, cfg: ModelConfig, read: Callable[[], dict[str, torch.Tensor]], layout_of: Any,
                   **_: Any) -> Loaded:
        """The tensors `read` gives (the whole file's, or a tensor-parallel rank's part: tp.py) and a new KV cache.
        Nothing outlives the process here: no node copy to restore from."""
        t0 = time.perf_counter()
        weights = {name: t.to(self.device) for name, t in read().items()}
        fused = _fuse_local(weights)
        dtype = weights["tok_embeddings.weight"].dtype
        layout: JournalLayout = layout_of(dtype, None)
        kv = torch.zeros(kv_shape(cfg, layout.num_blocks, layout.block_size), dtype=dtype, device=self.device)
        journal = {n: torch.zeros(shape, dtype=dt, device=self.device) for n, (dt, shape) in layout.tensors().items()}
        return Loaded(weights, kv, journal, "file", False, layout, {"load_ms": ms_since(t0)}, fused)

    def attach(self, cfg: ModelConfig, layout_of: Any) -> Loaded:
        raise RuntimeError("local memory has nothing to reattach")

    def takeover(self, cfg: ModelConfig, predecessor: str, token: str, layout_of: Any, wait_s: float, *,
                 fenced: bool = False, known: Loaded | None = None) -> Loaded:
        raise RuntimeError("local memory cannot take over a predecessor's leases: run with --memory leased")

    def start_heartbeats(self) -> None:
        pass

    def close(self) -> None:
        pass


class LeasedMemory:
    kind = "leased"

    def __init__(self, engine_id: str, *, socket_path: str | None, gpu: int) -> None:
        from libs.client.memory import MemoryClient, exit_on_lease_lost  # the SDK: only when leases are used

        self.gpu = gpu
        from engines.reference.startup import engine_class

        self.client: Any = MemoryClient.connect(engine_id, socket_path=socket_path, engine_class=engine_class("batched"))
        self.client.on_lease_lost = exit_on_lease_lost

    def pending(self) -> bool:
        return bool(self.client.pending())

    def load(self, cfg: ModelConfig, path: Path, layout_of: Any, num_blocks: int | None = None) -> Loaded:
        """A cold start: the node's copy of this class's weights if a sound one of this model's layout is there,
        else the file, each layer's fused parts back to back (fused_layout.py) either way: the copy was written
        from a lease of this class (safetensors_io.restore_or_load, the one cold path). `num_blocks`: the new
        cache's (default: the configuration's)."""
        t0 = time.perf_counter()
        got = self._weights(cfg, path)
        loaded = self._with_new_kv(cfg, got.lease, got.metas, layout_of, t0, num_blocks)
        loaded.weights_load = got.report()
        return loaded

    def _weights(self, cfg: ModelConfig, path: Path) -> Any:
        """The whole model's weights, cold (`load`'s one path): safetensors_io `WeightsLoad`."""
        from libs.client.safetensors_io import copy_name, restore_or_load

        return restore_or_load(self.client, path, copy=copy_name(self.client.engine_class), gpu=self.gpu,
                               expected=cfg.tensor_shapes(), plan=fused_plan, filler=lambda: lease_filler(path))

    def load_spare(self, cfg: ModelConfig, path: Path, layout_of: Any) -> Spare:
        """A spare's memory (config.py `spare`), at its start: the weights, loaded as a cold start loads them (`load`),
        and a KV cache of this configuration's size, zeroed, both committed: what its assignment continues on
        (`spare_takeover`), so that nothing is loaded, leased or zeroed in the outage."""
        t0 = time.perf_counter()
        got = self._weights(cfg, path)
        dtype = got.tensors["tok_embeddings.weight"].dtype
        layout: JournalLayout = layout_of(dtype, None)
        kv, journal, kv_lease = self._new_kv(cfg, dtype, layout)
        self.client.commit()
        return Spare(got, layout, kv, journal, kv_lease.id, ms_since(t0))

    def spare_takeover(self, cfg: ModelConfig, spare: Spare, predecessor: str, token: str, layout_of: Any,
                       wait_s: float) -> Loaded:
        """A spare's assignment, beside the weights and cache it holds since its start (`load_spare`): the
        predecessor's KV backup alone (frozen `backups_only`: its GPU failed; taken as a cold successor takes it,
        `cold_weights`), which start-up restores into the cache (backup_start.py), the source `backup`; or, no
        predecessor named (one that kept no backup), nothing, the source `spare`. Fenced: granted once the predecessor
        is stopped, read only once it has exited (`wait_fence`: its copies into the backup may still land until
        then). A backup of another block count (a predecessor of another cache size) gets a cache of its size instead
        of the spare's. Anything but backups handed on is refused (`NotBackupsAlone`): a predecessor's weights and
        cache are on another GPU, not this spare's."""
        t0 = time.perf_counter()
        backup: dict[str, torch.Tensor] | None = None
        fence: list[Any] = []
        timings: dict[str, Any] = {}
        if predecessor:
            att, timings = self._backups_granted(predecessor, token, wait_s, "a spare continues an engine",
                                                 fenced=True)
            for extra in att.leases[1:]:
                self.client.release(extra.id)
            backup, fence = _tensors(att.leases[0]), att.fence
            timings["takeover_ms"] = ms_since(t0)
        got, layout, kv, journal = spare.got, spare.layout, spare.kv, spare.journal
        dtype = kv.dtype
        if backup is not None and int(backup[BACKUP_NAME].shape[0]) != layout.num_blocks:
            log.info("the backup of %s holds %d blocks, this spare's cache %d: leasing one of its size", predecessor,
                     int(backup[BACKUP_NAME].shape[0]), layout.num_blocks)
            self.client.release(spare.kv_lease)
            layout = layout_of(dtype, int(backup[BACKUP_NAME].shape[0]))
            kv, journal, _ = self._new_kv(cfg, dtype, layout)
            self.client.commit()
            timings["new_cache_ms"] = ms_since(t0) - timings.get("takeover_ms", 0.0)
        weights = {m.name: got.lease.view(m, "torch") for m in got.metas}
        loaded = Loaded(weights, kv, journal,
                        "spare" if backup is None else "backup", False, layout, {**timings, "total_ms": ms_since(t0)},
                        _fused_views([(got.lease, m) for m in got.metas]), backup=backup)
        loaded.fence = fence
        return loaded

    def take_backups(self, gang_id: str, rank: int, successors: list[str], generation: int, token: str,
                     wait_s: float) -> Any:
        """Rank `rank` of a degraded successor (degrade.py; `successors`: its ranks' engine ids, one for a single
        engine): the broken gang's every KV backup, all to rank 0 (degrade.py `Degraded`; None on the other ranks,
        whose asks complete the group), the rest of the gang reclaimed in the same commit."""
        from libs.client.protocol import PredecessorAlive

        t0 = time.perf_counter()
        att, tries = retry_until(lambda: self.client.gang_takeover(gang_id, rank, successors, generation, token,
                                                                   degraded=True), (PredecessorAlive,), wait_s)
        return _degraded(att.leases, t0, {"tries": tries}) if rank == 0 else None

    def take_backup(self, predecessor: str, token: str, wait_s: float) -> Any:
        """Rank 0 of a group continuing a single engine (a regroup, degrade.py): that engine's KV backup alone (frozen
        `backups_only`, taken as `takeover` takes it for a cold successor: `cold_weights`), as degrade.py's
        `Degraded` of one rank; the group loads its weights cold. Anything but backups handed on is refused
        (`NotBackupsAlone`): a group cannot run from a single engine's weights or cache."""
        t0 = time.perf_counter()
        att, granted = self._backups_granted(predecessor, token, wait_s, "a group continues a single engine")
        return _degraded(att.leases, t0, granted)

    def _backups_granted(self, predecessor: str, token: str, wait_s: float, who: str, *,
                         fenced: bool = False) -> tuple[Any, dict[str, Any]]:
        """The predecessor's KV backup alone (frozen `backups_only`, taken with `cold_weights`), as `_granted`
        answers; anything else handed on is refused (`NotBackupsAlone`, saying who continues from the backup only)."""
        att, granted = self._granted(predecessor, token, wait_s, fenced=fenced, cold_weights=True)
        if not backups_alone(att.leases):
            # kept, not released (a release frees them): this engine exits on the refusal, its leases are orphaned
            # and wait out their grace window, where the control plane can freeze and hand them on again
            raise NotBackupsAlone(f"{predecessor} handed on {sorted(lease.info.name for lease in att.leases)}, not "
                                  f"its KV backup alone: {who} from its backup only "
                                  "(Freeze backups_only)")
        return att, granted

    def _granted(self, predecessor: str, token: str, wait_s: float, *, fenced: bool = False,
                 cold_weights: bool = False) -> tuple[Any, dict[str, Any]]:
        """The predecessor's leases (libs/client `takeover`) and the granting try's timings (its request and map, the
        tries). The fault is published as the predecessor begins to exit; the manager hands its memory over only
        once it is stopped (fenced) or gone, and frozen: retried at a short fixed interval."""
        from libs.client.protocol import NotFrozenYet, PredecessorAlive

        att, tries = retry_until(lambda: self.client.takeover(predecessor, token, fenced=fenced,
                                                              cold_weights=cold_weights),
                                 (PredecessorAlive, NotFrozenYet), wait_s)
        return att, {**self.client.last_timings_ms, "tries": tries}

    def release(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            self.client.release(lease_id)

    def load_shard(self, cfg: ModelConfig, read: Callable[[], dict[str, torch.Tensor]], layout_of: Any, *,
                   path: Path, tp: int, rank: int, num_blocks: int | None = None) -> Loaded:
        """A tensor-parallel rank's part of the weights, cold: the node's copy of this rank's shard (host tier, else
        artifact: restore_or_load, the one cold path; the copy named for the rank, safetensors_io invariant 3, and
        of this shard's shapes) if a sound one is there, else `read` (tp.py: the file by safetensors slices) copied
        into one weights lease named for the rank, laid out as `load` lays out a file (each layer's fused parts back
        to back). Either way a KV lease of its own (its kv heads), committed. A peer GPU's copy of the same shard
        (NVLink/P2P) would come first; it is not built (docs/engine-batched.md)."""
        from libs.client.safetensors_io import copy_name, restore_or_load, shard_lease_name

        t0 = time.perf_counter()
        name = shard_lease_name("weights", tp, rank)
        got = restore_or_load(self.client, path, copy=copy_name(self.client.engine_class, tp=tp, rank=rank),
                              gpu=self.gpu, expected=cfg.tensor_shapes(),
                              load_file=lambda: self._shard_into_lease(read(), name))
        loaded = self._with_new_kv(cfg, got.lease, got.metas, layout_of, t0, num_blocks)
        loaded.weights_load = got.report()
        return loaded

    def _shard_into_lease(self, tensors: dict[str, torch.Tensor], name: str) -> tuple[Any, list[Any]]:
        """These tensors in one new weights lease named `name`, in `write_order`, registered and committed (the
        commit is what the gpu_manager's copy policy waits for)."""
        placed, off = [], 0
        for tname in write_order(list(tensors)):
            t = tensors[tname]
            placed.append((tname, t, off))
            off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        lease = self.client.allocate(max(off, ALIGN), tag="weights", name=name, gpu=self.gpu)
        for _, t, at in placed:
            lease.torch(t.dtype, tuple(t.shape), at).copy_(t)
        metas = [lease.meta(tname, t.dtype, tuple(t.shape), at) for tname, t, at in placed]
        self.client.register(metas)
        self.client.commit()
        return lease, metas

    def _with_new_kv(self, cfg: ModelConfig, lease: Any, metas: list[Any], layout_of: Any, t0: float,
                     num_blocks: int | None = None) -> Loaded:
        """A cold start's tensors: the weights registered in `lease` and a new KV lease, committed."""
        weights = {m.name: lease.view(m, "torch") for m in metas}
        t_load = ms_since(t0)
        dtype = weights["tok_embeddings.weight"].dtype
        layout = layout_of(dtype, num_blocks)
        kv, journal, _ = self._new_kv(cfg, dtype, layout)
        self.client.commit()
        return Loaded(weights, kv, journal, "file", False, layout, {"load_ms": t_load, "total_ms": ms_since(t0)},
                      _fused_views([(lease, m) for m in metas]))

    def register_gang(self, gang_id: str, owners: list[str]) -> dict[str, Any]:
        """A tensor-parallel engine's ranks' leases become one gang (rank 0, once every rank committed)."""
        return dict(self.client.register_gang(gang_id, owners).model_dump())

    def gang_takeover(self, cfg: ModelConfig, gang_id: str, rank: int, successors: list[str], generation: int,
                      token: str, layout_of: Any, wait_s: float) -> Loaded:
        """Rank `rank` of a successor group: its rank's leases of the frozen gang (weights, KV cache and journal),
        once the whole group asked (the manager moves every rank's leases in one commit, or none)."""
        from libs.client.protocol import PredecessorAlive

        t0 = time.perf_counter()
        att, _ = retry_until(lambda: self.client.gang_takeover(gang_id, rank, successors, generation, token),
                             (PredecessorAlive,), wait_s)
        return self._rebuild(cfg, att.leases, "takeover", layout_of, t0)

    def reserve(self, cfg: ModelConfig, path: Path, layout_of: Any) -> Loaded:
        """A standby's tensors where a takeover is expected to map its predecessor's leases (placeholder memory
        until then: their content is garbage; nothing may depend on it). A takeover maps each lease into its
        reservation when the size matches, else elsewhere (then `placed_alike` says what moved)."""
        t0 = time.perf_counter()
        _, _, nbytes, metas = weights_plan(path, "reserved")
        wres = self.client.reserve(nbytes, tag="weights", name="weights", gpu=self.gpu)
        weights = {m.name: wres.torch(m.dtype, m.shape, m.offset) for m in metas}
        fused = _fused_views([(wres, m) for m in metas])
        dtype = weights["tok_embeddings.weight"].dtype
        layout: JournalLayout = layout_of(dtype, None)
        kres = self.client.reserve(lease_bytes(cfg, dtype, layout), tag="kv_cache", name=KV_NAME, gpu=self.gpu)
        views = {name: kres.torch(dt, shape, off) for name, dt, shape, off in _packed(cfg, dtype, layout)}
        return Loaded({n: weights[n] for n in cfg.tensor_shapes()}, views[KV_NAME],
                      {n: views[n] for n in layout.tensors()}, "reserved", False, layout,
                      {"reserve_ms": ms_since(t0), "reserved_bytes": wres.size + kres.size}, fused,
                      placed=placement(wres.ptr, metas))

    def attach(self, cfg: ModelConfig, layout_of: Any) -> Loaded:
        t0 = time.perf_counter()
        att = self.client.attach()
        return self._rebuild(cfg, att.leases, "reattached", layout_of, t0)

    def takeover(self, cfg: ModelConfig, predecessor: str, token: str, layout_of: Any, wait_s: float, *,
                 fenced: bool = False, known: Loaded | None = None, weights: Path | None = None) -> Loaded:
        """The predecessor's leases. `fenced`: granted once it is stopped, its exit still to come: the caller reads
        and writes them only after `wait_fence` (nothing here reads their content). `known`: tensors built before
        over the addresses the leases are mapped at (a prepared standby's), reused where they are the very view a
        lease's tensor would get (`_view`). `weights`: this engine can load the weights itself (a cold successor),
        so it may be handed the predecessor's KV backup alone (its weights and cache lost with their GPU): the
        weights are then loaded cold (`load`) beside a new cache of the backup's block count, which start-up
        restores from the backup (backup_start.py), the source `backup`."""
        t0 = time.perf_counter()
        att, granted = self._granted(predecessor, token, wait_s, fenced=fenced, cold_weights=weights is not None)
        if weights is not None and backups_alone(att.leases):
            for extra in att.leases[1:]:
                self.client.release(extra.id)
            backup = _tensors(att.leases[0])
            taken = ms_since(t0)
            loaded = self.load(cfg, weights, layout_of, num_blocks=int(backup[BACKUP_NAME].shape[0]))
            loaded.source, loaded.backup = "backup", backup
            loaded.timings_ms = {"takeover_ms": taken, **granted, **loaded.timings_ms, "total_ms": ms_since(t0)}
            return loaded
        loaded = self._rebuild(cfg, att.leases, "takeover", layout_of, t0, known)
        loaded.timings_ms.update(granted)
        loaded.fence = att.fence
        return loaded

    def _rebuild(self, cfg: ModelConfig, leases: list[Any], source: str, layout_of: Any, t0: float,
                 known: Loaded | None = None) -> Loaded:
        t_attach = ms_since(t0)
        have = {**known.weights, **known.fused} if known is not None else {}
        caches = sorted((lease for lease in leases if any(m.name == KV_NAME for m in lease.tensor_metas)),
                        key=lambda lease: lease.info.created_at, reverse=True)
        # a KV backup lease (backup.py, host memory): handed on beside the cache, or instead of a cache that was lost
        backups = [lease for lease in leases if any(m.name == BACKUP_NAME for m in lease.tensor_metas)]
        backup = _tensors(backups[0]) if backups else None
        # the predecessor's drain mark (drain.py): read by the fence, then this engine's own
        drains = [lease for lease in leases if any(m.name == DRAIN_NAME for m in lease.tensor_metas)]
        drain = next((lease.view(m, "torch") for lease in drains[:1] for m in lease.tensor_metas), None)
        leases = [lease for lease in leases if lease not in drains]
        for extra in drains[1:]:
            self.client.release(extra.id)
        held = [lease for lease in leases if lease not in caches and lease not in backups]
        if (known is not None and known.placed is not None and len(held) == 1
                and placement(held[0].ptr, held[0].tensor_metas) == known.placed):
            # the weights lease lies exactly where, and as, the prepared standby's tensors were laid out over its
            # reservation: every view of it (and of its fused groups) is one it holds (H200, 8b: ~300 views checked
            # one by one took 4-8 ms of the takeover)
            weights, fused, t_views = known.weights, known.fused, time.perf_counter()
            reused = len(weights) + len(fused)
        else:
            reused = 0
            tensors = {m.name: _view(lease, m.name, m.offset, m.shape, m.dtype, m.stride, have.get(m.name))
                       for lease in held for m in lease.tensor_metas}
            missing = [n for n in cfg.tensor_shapes() if n not in tensors]
            if missing:
                raise MissingWeights(f"the leases lack {len(missing)} weight tensors, e.g. {missing[:3]}")
            weights = {n: tensors[n] for n in cfg.tensor_shapes()}
            t_views = time.perf_counter()
            fused = _fused_views([(lease, m) for lease in held for m in lease.tensor_metas], have)
        # where a takeover's rebuild goes (views of every weight, then of the fused groups; the rest is the cache's)
        split = {"views_ms": round((t_views - t0) * 1000 - t_attach, 3), "fused_ms": ms_since(t_views),
                 "views_reused": reused}  # the prepared standby's views taken whole (0: each checked or made)
        dtype = weights["tok_embeddings.weight"].dtype
        for extra in caches[1:] + backups[1:]:
            self.client.release(extra.id)
        if caches:
            own = _tensors(caches[0])
            # The cache's size is the predecessor's (its free memory then, not this process's now): the rest of
            # the layout must be this configuration's for its journal to be read.
            kept = own[KV_NAME].shape[2] if KV_NAME in own and own[KV_NAME].dim() == 6 else None
            layout: JournalLayout = layout_of(dtype, kept)
            want = {n: shape for n, _, shape, _ in _packed(cfg, dtype, layout)}
            if all(n in own and tuple(own[n].shape) == s for n, s in want.items()):
                journal = {n: own[n] for n in layout.tensors()}
                return Loaded(weights, own[KV_NAME], journal, source, True, layout,
                              {"attach_ms": t_attach, **split, "total_ms": ms_since(t0)}, fused, backup=backup, drain=drain)
            log.info("the handed-on KV lease does not fit this configuration; leasing a new one")
            self.client.release(caches[0].id)
        # A lost cache restored from its backup (backup.py) needs the backup's block count: its block ids are kept.
        layout = layout_of(dtype, backup[BACKUP_NAME].shape[0] if backup is not None else None)
        kv, journal, _ = self._new_kv(cfg, dtype, layout)
        self.client.commit()
        return Loaded(weights, kv, journal, source, False, layout, {"attach_ms": t_attach, **split, "total_ms": ms_since(t0)},
                      fused, backup=backup, drain=drain)

    def _new_kv(self, cfg: ModelConfig, dtype: torch.dtype,
                layout: JournalLayout) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
        """A new KV lease (the cache and the journal, packed), registered, not committed: (cache, journal, lease)."""
        packed = _packed(cfg, dtype, layout)
        lease = self.client.allocate(lease_bytes(cfg, dtype, layout), tag="kv_cache", name=KV_NAME, gpu=self.gpu)
        views = {name: lease.torch(dt, shape, off) for name, dt, shape, off in packed}
        views[KV_NAME].zero_()
        self.client.register([lease.meta(name, dt, shape, off) for name, dt, shape, off in packed])
        return views[KV_NAME], {n: views[n] for n in layout.tensors()}, lease

    def start_heartbeats(self) -> None:
        self.client.start_heartbeats()

    def close(self) -> None:
        try:
            self.client.close(unmap=False)  # the leases stay with the gpu_manager for a successor
        except Exception as e:  # noqa: BLE001 - closing on the way out: the process ends anyway
            log.warning("closing the memory client failed: %s", e)


def fused_plan(header: dict[str, Any], lease_id: str) -> tuple[list[Any], int]:
    """safetensors_io's layout with each layer's fused parts back to back (fused_layout.py), every tensor at a
    multiple of ALIGN."""
    from libs.client.safetensors_io import plan_layout

    in_file = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    return plan_layout(header, lease_id, write_order(in_file))


def weights_plan(path: Path, lease_id: str) -> tuple[int, list[tuple[str, int, int, int]], int, list[Any]]:
    """Where `load` puts a file's tensors in its weights lease: (the file's data start, [(name, lease offset, file
    offset, bytes)], the lease's bytes, the tensors' metadata naming `lease_id`). Read from the file's header alone."""
    from libs.client.safetensors_io import read_header

    data_start, header = read_header(path)
    layout, total = fused_plan(header, lease_id)
    return data_start, [(m.name, m.offset, start, n) for m, start, n in layout], total, [m for m, _, _ in layout]


def wait_fence(loaded: Loaded, wait_s: float, *, isolate: bool) -> tuple[dict[str, Any] | None, Pending | None]:
    """Wait until no predecessor of a fenced takeover can write the leases any more, or (`isolate`) until what it
    may still write is known: only then may the journal be read (on CUDA the dead engine's queued steps may still
    write it ~10-25 ms after a SIGKILL on an H200: scripts/probe_death_time.py) or anything be written. On the CPU
    its threads' exit ends it; on CUDA its drain mark (drain.py), once its threads are exiting: its queue proven
    ran ("drained"), or what it may still write, to stay clear of (isolation.py: "isolated", with that `Pending`);
    else its exit (the pidfd: its context torn down). ({"waited_ms", "how"}, the pending writes of an isolated
    takeover) (None: nothing to wait for). Raises TimeoutError after `wait_s`."""
    if not loaded.fence:
        return None, None
    t0 = time.perf_counter()
    cpu = loaded.kv.device.type == "cpu"
    pages = PageLayout(loaded.layout.slots, loaded.layout.num_blocks)
    gen = journal_generation(loaded)
    page = loaded.drain if gen is not None and pages.fits(loaded.drain) else None
    found: list[Pending] = []

    def proven() -> str | None:
        if cpu:
            return "stopped"
        assert page is not None and gen is not None
        p = pending(page, pages, gen)
        if p.drained:
            return "drained"
        if isolate and len(loaded.fence) == 1 and not p.header:
            found.append(p)
            return "isolated"
        return None

    hows = [await_fence(f.pid, f.pid_start, proven if cpu or page is not None else None,
                        timeout_s=wait_s - (time.perf_counter() - t0)) for f in loaded.fence]
    return {"waited_ms": ms_since(t0), "how": ",".join(sorted(set(hows)))}, found[-1] if hows == ["isolated"] else None


def journal_generation(loaded: Loaded) -> int | None:
    """The handed-on journal's generation (journal.py invariant 6); None: no journal of this layout to read."""
    return Journal(loaded.layout, loaded.journal).generation() if loaded.kv_handed_on else None


def placed_alike(a: Loaded, b: Loaded) -> list[str]:
    """The tensors (weights, fused groups, the KV cache) whose address, shape, strides, dtype or device differ
    between `a` and `b`; empty: whatever was built over `a` (a runner, its CUDA graphs) runs on `b` unchanged."""
    def sig(t: torch.Tensor | None) -> tuple[Any, ...] | None:
        return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)

    pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = [("kv_cache", a.kv, b.kv)]
    pairs += [(n, t, b.weights.get(n)) for n, t in a.weights.items()]
    pairs += [(n, t, b.fused.get(n)) for n, t in a.fused.items()]
    pairs += [(n, None, t) for n, t in b.fused.items() if n not in a.fused]
    return [n for n, x, y in pairs if sig(x) != sig(y)]


def _fused_views(registered: list[tuple[Any, Any]], have: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One zero-copy view over each fused group the weights lease holds back to back (fused_layout.py); a tensor in
    `have` by the group's name where it is that very view."""
    from libs.client.protocol import DTYPE_SIZES

    placed = [Placed(m.name, lease, m.offset, tuple(m.shape), m.dtype, DTYPE_SIZES.get(m.dtype, 0), m.stride is None)
              for lease, m in registered]
    have = have or {}
    return {name: _view(first.lease, name, first.offset, shape, first.dtype, None, have.get(name))
            for name, (first, shape) in fused_runs(placed).items()}


def _view(lease: Any, name: str, offset: int, shape: Any, dtype: str, stride: Any, have: torch.Tensor | None) -> torch.Tensor:
    """`have` if it is exactly the view of `lease` this tensor gets (address, shape, strides, dtype, device: a
    prepared standby's, built over the reservation the lease now fills), else a new view. A takeover of 8b built
    ~400 views again (7-12 ms of a shadow's 45-80 ms to ready, H200) that its prepared runner already held."""
    shape = tuple(shape)
    if (have is not None and have.data_ptr() == lease.mapping.ptr + offset and tuple(have.shape) == shape
            and str(have.dtype).removeprefix("torch.") == dtype and str(have.device) == lease.mapping.device
            and have.stride() == tuple(stride if stride is not None else contiguous_stride(list(shape)))):
        return have
    return lease.torch(dtype, shape, offset, stride)  # type: ignore[no-any-return]


def _fuse_local(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local memory (no lease to keep): each fused group copied into one tensor, its parts made views of it."""
    fused: dict[str, torch.Tensor] = {}
    layers = sorted({n.split(".")[1] for n in weights if n.startswith("layers.")}, key=int)
    for i in layers:
        p = f"layers.{i}."
        for name, parts in FUSED.items():
            if not all(p + n in weights for n in parts):
                continue
            buf = torch.cat([weights[p + n] for n in parts])
            at = 0
            for n in parts:
                rows = weights[p + n].shape[0]
                weights[p + n] = buf[at:at + rows]
                at += rows
            fused[p + name] = buf
    return fused


def open_memory(cfg: EngineConfig, device: torch.device) -> LocalMemory | LeasedMemory:
    """The engine's memory as its configuration says: leased from the gpu_manager, or local tensors (`auto`: leased
    when a gpu_manager socket exists)."""
    mode = cfg.memory
    if mode == "auto":
        sock = cfg.gpu_manager_socket or os.environ.get("HF_GPU_MANAGER_SOCKET")
        mode = "leased" if sock and Path(sock).exists() else "local"
    if mode == "local":
        return LocalMemory(device)
    return LeasedMemory(cfg.id, socket_path=cfg.gpu_manager_socket, gpu=cfg.gpu)


def layout_fn(cfg: EngineConfig, mcfg: ModelConfig, device: torch.device) -> Callable[..., JournalLayout]:
    """The KV cache and journal layout of this configuration, as a function of the weights' dtype and of a handed-on
    cache's block count."""
    peers = [shard_config(get_config(cfg.size), cfg.tp, r) for r in range(cfg.tp)] if cfg.tp > 1 else []

    def layout_of(dtype: torch.dtype, num_blocks: int | None) -> JournalLayout:
        """This configuration's layout; `num_blocks` given: a handed-on cache's size, kept."""
        return kv_layout(mcfg, dtype, device, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                         max_len=cfg.max_model_len or mcfg.max_seq, num_blocks=num_blocks or cfg.num_blocks,
                         kv_cache_gib=cfg.kv_cache_gib, peers=peers)

    return layout_of
