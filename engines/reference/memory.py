"""Where the engine's tensors come from: the only module of the engine that talks to the memory SDK.

- `LocalMemory`: plain tensors read from the weights file (standalone runs and tests without a gpu_manager).
- `LeasedMemory`: Holdfast leases through `libs.client.memory`: weights loaded into `weights` leases, the
  KV cache a lease of tag `kv_cache`; on a restart it reattaches leases that wait for this engine, and a
  successor takes over a predecessor's leases. Tensors come back from the registered metadata, so a
  reattach reads nothing from disk.

The KV lease holds the cache and, after it, the marks of its finished positions (kv_reuse.py), registered as
tensors `kv_cache` and `kv_marks`.

A warm standby may *shadow* an active engine: `shadow()` maps that engine's weights and KV lease read-only (a
share token the agent got from the gpu_manager) and leases a KV cache of its own, so the standby's model is
built and warm before any failure, and the predecessor's cache can give resumed requests their prefixes
(`Loaded.donor`). `adopt()` then takes the predecessor's leases over for real (after its death, as the
gpu_manager enforces): the weights keep their mappings (the SDK reuses them), and the predecessor's KV lease
is released once the donor is retired (`retire_donor`), whichever of the two comes last.

Invariant: the engine core only ever sees `Loaded` (named weight tensors, one KV tensor, its marks, a donor);
it never imports the SDK, so the same core runs over leased or ordinary memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from engines.reference.config import ModelConfig
from engines.reference.kv_reuse import KvDonor, marks_shape
from engines.reference.weights import check_file_matches, lease_filler, load_weights, torch_dtype
from libs.common.procs import ms_since

log = logging.getLogger("holdfast.engine.memory")

KV_NAME = "kv_cache"
MARKS_NAME = "kv_marks"
MARKS_ALIGN = 256
T = TypeVar("T")


@dataclass
class Loaded:
    weights: dict[str, torch.Tensor]
    kv: torch.Tensor
    source: str  # "file" (cold load), "reattached" (own leases after a restart), "takeover" (a predecessor's),
    # "shadow" (a live engine's weights, read-only, for a warm standby)
    timings_ms: dict[str, float] = field(default_factory=dict)
    read_only: bool = False  # the weights are mapped read-only (a write faults)
    marks: torch.Tensor | None = None  # the cache's marks (leased caches only): kv_reuse.py
    donor: KvDonor | None = None  # a shadowed predecessor's cache, for resumed requests' prefixes
    weights_load: dict[str, Any] | None = None  # a cold load's source (host, artifact, file) and time (WeightsLoad)



def retry_until(call: Callable[[], T], retry_on: tuple[type[BaseException], ...], within_s: float,
                interval_s: float = 0.005) -> tuple[T, int]:
    """`call()`'s result and the number of tries, trying again on `retry_on` until `within_s` has passed
    (then the last such error is raised). For waits on another process (a predecessor's death, a manager
    restart) measured in milliseconds: a fixed short interval, no backoff."""
    deadline = time.monotonic() + within_s
    tries = 0
    while True:
        tries += 1
        try:
            return call(), tries
        except retry_on:
            if time.monotonic() > deadline:
                raise
            time.sleep(interval_s)


def kv_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype:
    return weights["tok_embeddings.weight"].dtype


def is_cache(lease: Any) -> bool:
    """Whether a mapped lease holds a KV cache (the tensor `kv_cache` registered in it)."""
    return any(m.name == KV_NAME for m in lease.tensor_metas)


def split_tensors(cfg: ModelConfig, leases: list[Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None,
                                                                 torch.Tensor | None, list[str]]:
    """(weights, KV cache, its marks, the ids of the KV leases, newest first) from an attachment's leases. An
    engine that took a predecessor's place may still hold that predecessor's KV lease beside its own
    (kv_reuse.py keeps it for a while): the newest is the cache, the others are for the caller to release. An
    engine from before the marks left none."""
    caches = sorted(filter(is_cache, leases), key=lambda lease: lease.info.created_at, reverse=True)
    tensors = {m.name: lease.view(m, "torch") for lease in leases if not is_cache(lease) for m in lease.tensor_metas}
    names = cfg.tensor_shapes()
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"the leases lack {len(missing)} weight tensors, e.g. {missing[:3]}")
    kv = marks = None
    if caches:
        own = {m.name: caches[0].view(m, "torch") for m in caches[0].tensor_metas}
        kv, marks = own.get(KV_NAME), own.get(MARKS_NAME)
    return {n: tensors[n] for n in names}, kv, marks, [lease.id for lease in caches]


class LocalMemory:
    """Ordinary tensors: a cold load every start; nothing survives the process."""

    kind = "local"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pending(self) -> bool:
        return False

    def load(self, cfg: ModelConfig, path: Path, slots: int, max_seq: int) -> Loaded:
        t0 = time.perf_counter()
        check_file_matches(path, cfg)
        weights = load_weights(path, self.device)
        t_load = ms_since(t0)
        kv = torch.zeros(cfg.kv_shape(slots, max_seq), dtype=kv_dtype(weights), device=self.device)
        return Loaded(weights, kv, "file", {"load_ms": t_load, "total_ms": ms_since(t0)})

    def load_shard(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], slots: int, max_seq: int) -> Loaded:
        """A tensor-parallel rank's part of the weights (tp.read_shard), and its KV cache."""
        t0 = time.perf_counter()
        weights = {name: t.to(self.device) for name, t in tensors.items()}
        kv = torch.zeros(cfg.kv_shape(slots, max_seq), dtype=kv_dtype(weights), device=self.device)
        return Loaded(weights, kv, "file", {"load_ms": ms_since(t0), "total_ms": ms_since(t0)})

    def attach(self, cfg: ModelConfig, slots: int, max_seq: int) -> Loaded:
        raise RuntimeError("local memory has nothing to reattach")

    def takeover(self, cfg: ModelConfig, predecessor: str, token: str, slots: int, max_seq: int) -> Loaded:
        raise RuntimeError("local memory cannot take over a predecessor's leases: run with --memory leased")

    def shadow(self, cfg: ModelConfig, owner: str, share_token: str, slots: int, max_seq: int) -> Loaded:
        raise RuntimeError("local memory cannot shadow another engine: run with --memory leased")

    def drop_shadow(self) -> None:
        pass

    def adopt(self, predecessor: str, token: str) -> dict[str, float]:
        raise RuntimeError("local memory cannot take over a predecessor's leases")

    def start_heartbeats(self) -> None:
        pass

    def close(self) -> None:
        pass


class LeasedMemory:
    """Holdfast leases from the node's gpu_manager (host or cuda backend, whichever it runs)."""

    kind = "leased"

    def __init__(self, engine_id: str, *, socket_path: str | None = None, engine_class: str = "reference",
                 gpu: int = 0) -> None:
        from libs.client.memory import MemoryClient, exit_on_lease_lost  # the SDK: only when leases are used

        self.gpu = gpu
        self.client: Any = MemoryClient.connect(engine_id, socket_path=socket_path, engine_class=engine_class)
        self.client.on_lease_lost = exit_on_lease_lost
        self._attachment: Any = None
        self._own_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # a shadowing standby's own KV cache, marks
        self._donor_lock = threading.Lock()
        self._donor_lease: str | None = None  # the shadowed predecessor's KV lease, mapped for its prefixes
        self._donor_retired = False
        self._adopted = False

    def pending(self) -> bool:
        return bool(self.client.pending())

    def load(self, cfg: ModelConfig, path: Path, slots: int, max_seq: int) -> Loaded:
        """A cold start: the node's copy of this class's weights if a sound one of this model's layout is there,
        else the file (safetensors_io.restore_or_load: the one cold path; the file is not read when a copy
        serves)."""
        from libs.client.safetensors_io import copy_name, restore_or_load

        t0 = time.perf_counter()
        got = restore_or_load(self.client, path, copy=copy_name(self.client.engine_class), gpu=self.gpu,
                              expected=cfg.tensor_shapes(), filler=lambda: lease_filler(path))
        weights = got.tensors
        t_load = ms_since(t0)
        kv, marks = self._new_kv(cfg, kv_dtype(weights), slots, max_seq)
        self.client.commit()
        return Loaded(weights, kv, "file", {"load_ms": t_load, "total_ms": ms_since(t0)}, marks=marks,
                      weights_load=got.report())

    def load_shard(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], slots: int, max_seq: int) -> Loaded:
        """A tensor-parallel rank's part of the weights (tp.read_shard) copied into one weights lease of its own,
        registered, with its KV lease, and committed."""
        t0 = time.perf_counter()
        layout, offset = {}, 0
        for name, t in tensors.items():
            layout[name] = offset
            offset += -(-t.numel() * t.element_size() // MARKS_ALIGN) * MARKS_ALIGN
        lease = self.client.allocate(max(offset, MARKS_ALIGN), tag="weights", name="weights", gpu=self.gpu)
        weights = {}
        for name, t in tensors.items():
            weights[name] = lease.torch(t.dtype, tuple(t.shape), layout[name])
            weights[name].copy_(t)
        self.client.register([lease.meta(name, t.dtype, tuple(t.shape), layout[name]) for name, t in tensors.items()])
        t_load = ms_since(t0)
        kv, marks = self._new_kv(cfg, kv_dtype(weights), slots, max_seq)
        self.client.commit()
        return Loaded(weights, kv, "file", {"load_ms": t_load, "total_ms": ms_since(t0)}, marks=marks)

    def register_gang(self, gang_id: str, owners: list[str]) -> dict[str, Any]:
        """This engine's ranks' leases become one gang (rank 0, once every rank committed)."""
        return self.client.register_gang(gang_id, owners).model_dump()

    def gang_takeover(self, cfg: ModelConfig, gang_id: str, rank: int, successors: list[str], generation: int,
                      token: str, slots: int, max_seq: int, wait_death_s: float = 30.0) -> Loaded:
        """Rank `rank` of a successor group: its rank's leases of the frozen gang, once the whole group asked."""
        from libs.client.protocol import PredecessorAlive

        t0 = time.perf_counter()
        self._attachment, _ = retry_until(
            lambda: self.client.gang_takeover(gang_id, rank, successors, generation, token), (PredecessorAlive,),
            wait_death_s)
        return self._rebuild(cfg, "takeover", slots, max_seq, t0)

    def attach(self, cfg: ModelConfig, slots: int, max_seq: int) -> Loaded:
        t0 = time.perf_counter()
        self._attachment = self.client.attach()
        return self._rebuild(cfg, "reattached", slots, max_seq, t0)

    def takeover(self, cfg: ModelConfig, predecessor: str, token: str, slots: int, max_seq: int,
                 wait_death_s: float = 30.0) -> Loaded:
        from libs.client.protocol import NotFrozenYet, PredecessorAlive

        t0 = time.perf_counter()
        # The failure is published as the predecessor begins to exit; its teardown (a CUDA context's: ~100 ms)
        # may not be over yet, and the manager hands memory over only after it; nor may the freeze (the
        # control plane may freeze while it promotes).
        self._attachment, _ = retry_until(lambda: self.client.takeover(predecessor, token),
                                          (PredecessorAlive, NotFrozenYet), wait_death_s)
        return self._rebuild(cfg, "takeover", slots, max_seq, t0)

    def shadow(self, cfg: ModelConfig, owner: str, share_token: str, slots: int, max_seq: int) -> Loaded:
        """The owner's weights and KV cache, read-only, and a KV cache of this engine's own (leased once, kept)."""
        t0 = time.perf_counter()
        self.drop_shadow()
        att = self.client.share(owner, share_token)
        t_attach = ms_since(t0)
        weights, their_kv, their_marks, caches = split_tensors(cfg, att.leases)
        if self._own_kv is None or tuple(self._own_kv[0].shape) != cfg.kv_shape(slots, max_seq):
            self._own_kv = self._new_kv(cfg, kv_dtype(weights), slots, max_seq)
            self.client.commit()
        read_only = all(lease.mapping.read_only for lease in att.leases)
        donor = None
        if their_kv is not None and their_marks is not None:
            with self._donor_lock:
                self._donor_lease = caches[0]
                self._donor_retired = self._adopted = False
            donor = KvDonor(their_kv, their_marks, on_retire=self._retire_donor_lease)
        kv, marks = self._own_kv
        return Loaded(weights, kv, "shadow", {"attach_ms": t_attach, "total_ms": ms_since(t0)}, read_only,
                      marks=marks, donor=donor)

    def drop_shadow(self) -> None:
        """Unmap a shadow. The caller has dropped every tensor built over it."""
        self.client.unshare()

    def adopt(self, predecessor: str, token: str) -> dict[str, float]:
        """Own the shadowed predecessor's leases (FROZEN -> ACTIVE here); release the ones not used (its KV)."""
        from libs.common.errors import Unavailable

        t0 = time.perf_counter()
        shadowed, own = set(self.client.shared), set(self.client.leases)
        try:
            att = self.client.takeover(predecessor, token)
        except Unavailable:
            # The connection broke under the request (a gpu_manager restart): it may have taken effect.
            # `attach` (after the SDK's reconnect) returns what this process holds now.
            att = self.client.attach()
            if not shadowed <= {lease.id for lease in att.leases}:
                raise Unavailable(f"the takeover of {predecessor}'s leases did not happen; to be tried again") from None
        t_takeover = ms_since(t0)
        with self._donor_lock:
            self._adopted = True
            caches = {lease.id for lease in att.leases if is_cache(lease)}
            keep = (shadowed - caches) | own  # the weights, this engine's cache, and the donor while it is read
            if self._donor_lease is not None and not self._donor_retired:
                keep.add(self._donor_lease)
            else:
                self._donor_lease = None
            unused = [lease.id for lease in att.leases if lease.id not in keep]
            for lease_id in unused:
                self.client.release(lease_id)
        return {"takeover_ms": t_takeover, "released": float(len(unused)), "total_ms": ms_since(t0)}

    def _retire_donor_lease(self) -> None:
        """The donor (the predecessor's KV lease, kept mapped for resumed requests) is no longer read: release
        it if this engine owns it by now; otherwise `adopt` will, as it takes it over."""
        with self._donor_lock:
            self._donor_retired = True
            lease_id = self._donor_lease if self._adopted else None
            if lease_id is None:
                return
            self._donor_lease = None
            try:
                self.client.release(lease_id)
            except Exception as e:  # noqa: BLE001 - left to the manager's reclaim: an orphan ages out
                log.warning("releasing the predecessor's KV lease %s failed: %s: %s", lease_id, type(e).__name__, e)

    def _rebuild(self, cfg: ModelConfig, source: str, slots: int, max_seq: int, t0: float) -> Loaded:
        t_attach = ms_since(t0)
        weights, kv, marks, caches = split_tensors(cfg, self._attachment.leases)
        for lease_id in caches[1:]:  # a predecessor's predecessor's cache, kept by it for reuse: not this engine's
            self.client.release(lease_id)
        t_views = ms_since(t0)
        want = cfg.kv_shape(slots, max_seq)
        if kv is None or marks is None or tuple(kv.shape) != want:
            # The predecessor's cache does not fit this configuration (or has no marks): lease a new one. One that
            # fits is this engine's own now, its slots holding the predecessor's requests kept as they are
            # (kv_reuse.py invariant 5) and the rest zeroed.
            log.info("KV cache lease missing or of another shape (%s); leasing a new one",
                     None if kv is None else tuple(kv.shape))
            kv, marks = self._new_kv(cfg, kv_dtype(weights), slots, max_seq)
            self.client.commit()
        return Loaded(weights, kv, source, {"attach_ms": t_attach, "views_ms": t_views, "total_ms": ms_since(t0)},
                      marks=marks)

    def _new_kv(self, cfg: ModelConfig, dtype: torch.dtype, slots: int,
                max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A KV lease: the cache, zeroed, then its marks (kv_reuse.py), both registered."""
        shape, mshape = cfg.kv_shape(slots, max_seq), marks_shape(slots, max_seq)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        offset = -(-nbytes // MARKS_ALIGN) * MARKS_ALIGN
        lease = self.client.allocate(offset + torch.Size(mshape).numel() * 8, tag="kv_cache", name=KV_NAME,
                                     gpu=self.gpu)
        kv = lease.torch(dtype, shape, 0)
        kv.zero_()
        marks = lease.torch(torch.int64, mshape, offset)
        self.client.register([lease.meta(KV_NAME, dtype, shape, 0), lease.meta(MARKS_NAME, torch.int64, mshape, offset)])
        return kv, marks

    def start_heartbeats(self) -> None:
        self.client.start_heartbeats()

    def close(self) -> None:
        # No unmap: a generation thread may still read the weights while the process winds down; the
        # mappings go with the process, and the leases stay with the gpu_manager (orphaned, then reclaimed
        # after their grace window unless a successor claims them).
        try:
            self.client.close(unmap=False)
        except Exception as e:  # noqa: BLE001 - closing on the way out: the process ends anyway
            log.warning("closing the memory client failed: %s", e)


def scratch_weights(cfg: ModelConfig, device: torch.device, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Random tensors of one layer's shapes, for a standby to warm its kernels before it owns any lease."""
    dt = torch_dtype(dtype or cfg.dtype)
    return {name: torch.empty(shape, device=device, dtype=dt).normal_(0.0, 0.02)
            for name, shape in cfg.with_layers(1).tensor_shapes().items()}
