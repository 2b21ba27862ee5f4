"""A warm standby's read-only shadow of the engine it may take over, and the journal read through it before the
takeover (a pre-read): the successor's adoption work done while its predecessor's process is still being torn
down, not after.

The agent offers the standby a share of an active engine's leases (services/agent/shadows.py); the standby maps
them read-only (`MemoryClient.share`) and keeps only the journal's views. When the agent says the owner is down
(`owner_down`, as it publishes the fault) or assigns the takeover (sent with the SIGKILL, before the death is
confirmed, for a standby that shadows the predecessor), the standby reads the journal through the shadow
(`Journal.read`: no write) and drops the shadow, so that the takeover maps the leases into the addresses the
standby's runner was built over. Then `build_engine` re-validates the pre-read against the journal it owns.

Invariants:
1. Nothing is written through the shadow: the standby writes the KV cache and the journal only after
   `MemoryClient.takeover` returned, which the gpu_manager grants only once the predecessor's process is gone
   (PredecessorAlive until then) and the lease's epoch is the successor's.
2. A pre-read is used only if `Journal.unchanged` holds over the owned lease (header and every row as read:
   the predecessor's last writes, queued on its CUDA stream or cut off by the kill, may land after the read);
   otherwise the journal is read again (`build_engine`, `pre_read: "stale"`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.batched.journal import Journal, JournalLayout, JournalMismatch, JournalRead

log = logging.getLogger("holdfast.engine.batched.shadow")


@dataclass
class PreRead:
    """A journal read through the shadow of `owner`, and when (perf_counter) it was made."""

    owner: str
    read: JournalRead
    at: float
    read_ms: float


@dataclass
class Shadow:
    """The journal views of the engine this standby shadows (None: none)."""

    client: Any  # libs.client.memory.MemoryClient
    layout: JournalLayout
    owner: str | None = None
    views: dict[str, torch.Tensor] = field(default_factory=dict)

    def map(self, owner: str, share_token: str) -> bool:
        """Map `owner`'s leases read-only; keep its journal's views if they are this configuration's."""
        self.drop()
        att = self.client.share(owner, share_token)
        views = {m.name: lease.view(m, "torch") for lease in att.leases for m in lease.tensor_metas
                 if m.name in self.layout.tensors()}
        want = {n: shape for n, (_, shape) in self.layout.tensors().items()}
        if not all(n in views and tuple(views[n].shape) == s for n, s in want.items()):
            log.info("the shadow of %s holds no journal of this configuration: no pre-read", owner)
            self.client.unshare()
            return False
        self.owner, self.views = owner, {n: views[n] for n in want}
        return True

    def pre_read(self, owner: str) -> PreRead | None:
        """The journal of `owner` as it is now, read through the shadow (None: not shadowing it, or no journal)."""
        if self.owner != owner:
            return None
        t0 = time.perf_counter()
        try:
            read = Journal(self.layout, self.views).read()
        except JournalMismatch as e:
            log.info("no pre-read of %s's journal: %s", owner, e)
            return None
        return PreRead(owner, read, t0, round((time.perf_counter() - t0) * 1000, 3))

    def drop(self) -> None:
        """Unmap the shadow (its views go first: they become invalid)."""
        if self.owner is None and not self.client.shared:
            return
        self.owner, self.views = None, {}
        self.client.unshare()


def wait_assignment(link: Any, shadow: Shadow | None) -> tuple[Any, PreRead | None]:
    """The standby's instructions until its assignment: shadows mapped and dropped as the agent says, the journal
    pre-read when the shadowed owner goes down (or, at the latest, at the assignment). Returns the assignment and
    the pre-read of its predecessor's journal, if any; the shadow is dropped before returning."""
    from libs.client.agent_link import Assignment, OwnerDown, Unshadow
    from libs.client.agent_link import Shadow as ShadowIns

    pre: PreRead | None = None
    while True:
        ins = link.wait_instruction()
        if isinstance(ins, ShadowIns) and shadow is not None:
            try:
                ok = shadow.map(ins.owner, ins.share_token)
            except Exception as e:  # noqa: BLE001 - a shadow is an optimisation: refused, the standby still serves
                log.warning("cannot shadow %s: %s", ins.owner, e)
                ok = False
            link.shadowing(ins.owner if ok else None, read_only=True)
        elif isinstance(ins, Unshadow) and shadow is not None:
            shadow.drop()
            pre = None
            link.shadowing(None)
        elif isinstance(ins, OwnerDown) and shadow is not None:
            pre = shadow.pre_read(ins.owner)
        elif isinstance(ins, Assignment):
            if shadow is not None:
                if pre is None or pre.owner != ins.predecessor:
                    pre = shadow.pre_read(ins.predecessor)
                shadow.drop()
            return ins, pre
