"""Warm standbys shadow serving engines: the agent asks the gpu_manager for a read-only share of an active
engine's weights and hands the token to a standby over its link (`shadow`); the standby maps them, builds
its model over them and says `shadowing`. A takeover of that engine by that standby then needs no kill
confirmation, no attach and no model build (takeover.py, engines/reference/standby.py).

Which standby shadows which engine is `supervision.shadow_plan` (pure); this module only sends. A standby
that could not shadow an engine says `shadowing None` and is not offered that engine again; a share the
gpu_manager refuses (the engine has no committed weights yet) is offered again on a later pass.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any, Protocol

from libs.common.bus import Bus
from libs.common.errors import HoldfastError
from libs.common.events import ShareWeights, ShareWeightsReply
from services.agent import supervision
from services.agent.engines import EngineRecord

log = logging.getLogger("holdfast.agent.shadows")


class Agent(Protocol):
    """What this module needs of the node's agent (supervisor.py's `Agent` is one): its engines' records, its
    bus and node, and the link to a standby. Named here so that this module does not import the supervisor."""

    bus: Bus
    node: str

    def records(self) -> list[EngineRecord]: ...

    def save(self, rec: EngineRecord) -> None: ...

    async def assign(self, rec: EngineRecord, msg: dict[str, Any]) -> None: ...

    def background(self, coro: Coroutine[Any, Any, Any], name: str) -> None: ...


async def reconcile(agent: Agent) -> None:
    plan = supervision.shadow_plan(agent.records())
    for sb in plan.drop:
        log.info("standby %s: %s is gone; dropping its shadow", sb.engine_id, sb.shadows)
        sb.shadows = None
        agent.save(sb)
        try:
            await agent.assign(sb, {"op": "unshadow"})
        except (ConnectionError, OSError) as e:
            log.warning("cannot tell standby %s to drop its shadow: %s", sb.engine_id, e)
    for sb, target in plan.offer:
        sb.shadow_offered = target.engine_id
        agent.background(_offer(agent, sb, target), f"shadow:{sb.engine_id}")


async def _offer(agent: Agent, sb: EngineRecord, target: EngineRecord) -> None:
    try:
        reply = await agent.bus.request(agent.node, ShareWeights(owner=target.engine_id, grantee=sb.engine_id),
                                        ShareWeightsReply, timeout=5.0)
        await agent.assign(sb, {"op": "shadow", "owner": target.engine_id, "share_token": reply.share_token})
        log.info("standby %s offered a shadow of %s (%d leases, %.2f GiB)", sb.engine_id, target.engine_id,
                 len(reply.lease_ids), reply.bytes / 2**30)
    except (HoldfastError, ConnectionError, OSError, TimeoutError) as e:
        log.info("no shadow of %s for %s yet: %s: %s", target.engine_id, sb.engine_id, type(e).__name__, e)
        if sb.shadow_offered == target.engine_id:
            sb.shadow_offered = None  # the next pass tries again


def shadowing(agent: Agent, rec: EngineRecord, owner: str | None) -> None:
    """The standby's word on its shadow (after an offer, an unshadow, or a re-registration)."""
    if owner is None and rec.shadow_offered is not None:
        rec.shadow_refused.add(rec.shadow_offered)
    rec.shadow_offered = None
    if rec.shadows != owner:
        rec.shadows = owner
        agent.save(rec)
