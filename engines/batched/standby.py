"""A prepared standby's wait for its assignment: it shadows the engine the agent names.

A prepared standby (__main__.py `prepare_runner`) holds its runner and CUDA graphs over reservations: the addresses
where a takeover is expected to map its predecessor's weights and KV cache, backed meanwhile by placeholder memory.
When the agent offers it an engine to shadow (`Shadow`, services/agent/shadows.py), it maps that engine's committed
weight and KV cache leases into those reservations (`MemoryClient.share(..., into_reserved=True)`), so that the
takeover of that engine maps nothing: the leases are where the runner was built, and the fenced takeover's grant
only makes them this process's (on the host backend the shadow is read-only until then; on CUDA the weights are
read-only where the driver grants it, the KV cache read-write: invariant 1 is what keeps the standby from writing it,
and no write access is granted on the takeover's path, libs/client/memory.py `_map_grant`). `Unshadow`, or an
assignment to take over another engine, gives the reservations their placeholders back first.

Invariants:
1. While it shadows, the standby runs no GPU work: its runner's addresses are the owner's live memory. It waits here,
   between preparing (every kernel and graph already run over the placeholders) and its assignment.
2. A shadow that does not land wholly in the reservations (another size or placement of the owner's leases) is
   dropped at once and refused to the agent (`shadowing None`): the takeover then maps the leases as before.
3. The shadow's memory is the owner's: a shadow never extends a lease's life (the agent drops it when the owner
   leaves the node, shadows.py) and the takeover's grant, not the shadow, makes it this engine's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from libs.client.agent_link import AgentLink, Assignment, Shadow, Unshadow
from libs.common.errors import HoldfastError

log = logging.getLogger("holdfast.engine.batched.standby")


def await_assignment(link: AgentLink, memory: Any, info: dict[str, Any]) -> Assignment:
    """Follow the agent's instructions until the assignment; shadow whom it names meanwhile. `info["shadow"]` says
    whom this standby shadows and how long the mapping took (the engine's /health)."""
    client = memory.client
    while True:
        ins = link.wait_instruction()
        if isinstance(ins, Assignment):
            if client.shared and link.shadows != ins.predecessor:  # the reservations' placeholders back first
                log.info("dropping the shadow of %s: assigned to take over %s", link.shadows, ins.predecessor)
                client.unshare()
                info.pop("shadow", None)
            return ins
        if isinstance(ins, Shadow):
            shadow(link, client, info, ins)
        elif isinstance(ins, Unshadow):
            drop(link, client, info)
        # OwnerDown: the assignment follows (or an unshadow); nothing to do until then


def shadow(link: AgentLink, client: Any, info: dict[str, Any], ins: Shadow) -> None:
    client.unshare()
    t0 = time.perf_counter()
    try:
        att = client.share(ins.owner, ins.share_token, into_reserved=True)
    except (HoldfastError, OSError) as e:
        log.warning("cannot shadow %s: %s", ins.owner, e)
        client.unshare()
        link.shadowing(None)
        return
    outside = [lease.id for lease in att.leases if lease.id not in client.shadow_reservations]
    if outside:  # invariant 2
        log.warning("the leases of %s do not fit this standby's reservations (%s): not shadowing it", ins.owner,
                    outside)
        client.unshare()
        link.shadowing(None)
        return
    read_only = all(lease.mapping.read_only for lease in att.leases)
    info["shadow"] = {"owner": ins.owner, "leases": len(att.leases), "read_only": read_only,
                      "map_ms": round((time.perf_counter() - t0) * 1000, 3)}
    log.info("shadowing %s: %d leases mapped into the reservations in %.1f ms (%s)", ins.owner, len(att.leases),
             info["shadow"]["map_ms"], "read-only" if read_only else "read-write, written only once taken over")
    link.shadowing(ins.owner, read_only=read_only)


def drop(link: AgentLink, client: Any, info: dict[str, Any]) -> None:
    if client.shared:
        log.info("dropping the shadow of %s: the agent said so", link.shadows)
    client.unshare()
    info.pop("shadow", None)
    link.shadowing(None)
