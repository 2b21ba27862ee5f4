"""KV backup to host, at start-up (backup.py has the writer and the restore): the backup a rank writes, opened
(restored from, kept, or leased anew) and the timeline's line for a restore.

Every rank of a group opens its own at the same point of its start-up, before the group's gang is registered
(tp_group.py), so its lease is the gang's; `channel` (backup.py `SoloChannel`, tp_group.py `BackupChannel`) carries
the ranks' one decision (kv_backup.py `group_restores`) and rank 0's restore plan.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engines.batched.backup import SOLO, BackupWriter, lease_bytes, packed, restore
from engines.batched.journal import Journal, JournalLayout
from engines.batched.kv_backup import BACKUP_NAME, Backed, group_restores

log = logging.getLogger("holdfast.engine.batched.backup")


def allocate(memory: Any, kv: torch.Tensor, layout: JournalLayout, *, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """A new backup: a host-memory lease (tag `other`, named `kv_backup`, a group's rank's `kv_backup.tp<N>-r<r>`;
    registered and committed: frozen and handed on with the engine's other leases), or pinned tensors with local
    memory (nothing survives the process then)."""
    items = packed(tuple(kv.shape), kv.dtype, layout)
    if getattr(memory, "kind", "") != "leased":
        pin = kv.device.type == "cuda"
        return {n: torch.zeros(shape, dtype=dt, pin_memory=pin) for n, dt, shape, _ in items}
    from libs.client.safetensors_io import shard_lease_name  # the SDK: only when leases are used

    client = memory.client
    name = shard_lease_name(BACKUP_NAME, tp, rank)
    lease = client.allocate(lease_bytes(tuple(kv.shape), kv.dtype, layout), tag="other", name=name,
                            gpu=memory.gpu, host=True)  # a memfd on any backend, not taken by a fault of the GPU
    client.register([lease.meta(n, dt, shape, off) for n, dt, shape, off in items])
    client.commit()
    return {n: lease.torch(dt, shape, off) for n, dt, shape, off in items}


def fits(tensors: dict[str, torch.Tensor], kv: torch.Tensor, layout: JournalLayout) -> bool:
    want = {n: (dt, shape) for n, dt, shape, _ in packed(tuple(kv.shape), kv.dtype, layout)}
    return all(n in tensors and (tensors[n].dtype, tuple(tensors[n].shape)) == w for n, w in want.items())


def open_backup(cfg: Any, memory: Any, loaded: Any, channel: Any = SOLO) -> tuple[BackupWriter, dict[str, Any]] | None:
    """With `cfg.kv_backup`: the backup this rank writes, and what start-up did with it. A handed-on backup whose
    cache was lost (`loaded.kv_handed_on` false, or its journal never written; in a group: any rank's,
    `group_restores`) is restored into the cache first (the journal then adopted as a handed-on one); beside a
    handed-on cache it is started afresh (the cache is the better copy). Every rank of a group calls it at the same point of its start-up (`channel`'s
    collectives), before the gang is registered (tp_group.py `commit`)."""
    if not cfg.kv_backup:
        return None
    kv, layout = loaded.kv, loaded.layout
    tensors = loaded.backup
    info: dict[str, Any] = {"restored": 0, "source": "new"}
    book: dict[int, Backed] = {}
    if tensors is not None and not fits(tensors, kv, layout):
        log.warning("the handed-on KV backup does not fit this configuration; starting a new one")
        tensors = None
    # A handed-on cache whose journal was never written (the group's: rank 0's) holds no sequence a successor could
    # adopt: its holder died before it wrote one (a spare killed while it restored a backup into that cache). The
    # backup beside it is then the only copy of the sequences: restored into the cache, as for a lost one.
    handed = loaded.kv_handed_on and (cfg.tp_rank != 0 or Journal(layout, loaded.journal).matches())
    if loaded.kv_handed_on and not handed and tensors is not None:
        log.info("the handed-on KV cache holds no journal (its holder died before writing one): restoring the "
                 "handed-on KV backup into it")
    if group_restores(channel.gather((handed, tensors is not None))):
        assert tensors is not None
        info, book = restore(tensors, kv, Journal(layout, loaded.journal), layout, channel)
        info["source"] = "restored"
        loaded.kv_handed_on = info["restored"] > 0
    elif tensors is not None:
        info["source"] = "kept beside the handed-on cache"
    else:
        tensors = allocate(memory, kv, layout, tp=cfg.tp, rank=cfg.tp_rank)
    writer = BackupWriter(kv, tensors, layout, lag_ms=cfg.kv_backup_lag_ms,
                          chunk=cfg.prefill_chunk if cfg.deterministic else None, channel=channel)
    if book:
        writer.adopt(book)
    else:
        writer.fresh()
    writer.stats["registered"] = writer.copier.registered
    return writer, info


def describe_restore(info: dict[str, Any]) -> str | None:
    """One line for the incident's timeline when this engine's KV came from a host backup (None otherwise)."""
    if info.get("source") != "restored" or not info.get("restored"):
        return None
    return (f"KV from host backup: {info['restored']} sequences, {info['blocks']} blocks in {info['ms']:.1f} ms, "
            f"{info['recomputed_tokens']} positions recomputed; the tokens since its last round made again")
