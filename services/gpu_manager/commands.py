"""Control-plane commands over NATS request/reply: freeze, transfer, reclaim, list (models in libs.common.events).

freeze(owner)   every committed live lease of the owner -> FROZEN, with a fresh random transfer token
                (idempotent: a second freeze of the same frozen leases returns the same token, unless it is the
                node's agent's promotion for the same incident, whose token replaces it); emits MemoryFrozen. Once
                a successor took them over, a freeze of that owner for that incident answers with the handover
                (`handed_to`). Uncommitted leases are reclaimed instead; an owner without a committed weights
                lease gets `NoCommittedWeights` (not_found: the control plane cold-starts from the file).
                `backups_only`: the committed KV backups alone (host memory), for a successor that loads the
                weights itself (TakeoverReq `cold_weights`); the owner's other leases are left as they are.
transfer(owner, successor, token)   names the successor allowed to take the frozen leases over; the
                successor then sends `takeover` on the engine socket (kill-before-transfer is enforced there).
share(owner, grantee)   a token with which `grantee` may map the owner's weight leases read-only (a warm
                standby's shadow); nothing changes state, the owner keeps its leases.
reclaim(lease, force)   ORPHANED/FROZEN -> RECLAIMED now; an ACTIVE lease only with force.
thaw(incident)  the leases frozen for that incident -> ACTIVE, back to their owners (same epoch), all of them or
                none: refused (conflict) while any owner's process is gone. The controller's, when an incident
                begun on purpose failed with its engine still serving (nobody took the leases over, nothing stopped
                it): a lease left frozen would be reclaimed at its deadline under a live engine's mapping, and the
                table would count that memory free. Idempotent: nothing frozen for it, nothing thawed.
list(owner?, state?)    live leases of this node.
snapshot(lease, artifact?, host_tier)   write a committed lease to a weight artifact (restore.py), and keep a
                host tier copy if asked; answered once the artifact is whole on disk.
freeze_gang(gang) / reclaim_gang(gang, force)   every lease of every rank of a tensor-parallel engine's gang
                frozen under one token / reclaimed, or none (gangs.py); a gang's ranks are then taken over by a
                successor group through `gang_takeover` on the engine socket.
sleep_engine(engine, level, wake)   ask a live engine to sleep (release its KV cache's memory, level 2 its weights
                too) or wake, through its next heartbeat; answered once it did (sleep.py).
"""

from __future__ import annotations

import logging
import secrets

from libs.common.bus import Bus
from libs.common.errors import Conflict, NotFound
from libs.common.events import (
    Freeze,
    FreezeGang,
    FreezeGangReply,
    FreezeReply,
    LeaseState,
    ListLeases,
    ListLeasesReply,
    MemoryFrozen,
    Reclaim,
    ReclaimGang,
    ReclaimGangReply,
    ReclaimReply,
    ShareWeights,
    ShareWeightsReply,
    SleepEngine,
    SleepEngineReply,
    SnapshotLease,
    SnapshotReply,
    Thaw,
    ThawReply,
    Transfer,
    TransferReply,
)
from services.gpu_manager.fsm import LIVE, LeaseEvent
from services.gpu_manager.gangs import GangBook
from services.gpu_manager.manager import LeaseBook, Move, NoCommittedWeights, split_for_freeze
from services.gpu_manager.records import LeaseRecord
from services.gpu_manager.restore import WeightCopies
from services.gpu_manager.sleep import Sleeper

log = logging.getLogger("holdfast.gpu_manager.commands")


class Commands:
    def __init__(self, book: LeaseBook, copies: WeightCopies, sleeper: Sleeper, gangs: GangBook) -> None:
        self.book = book
        self.gangs = gangs
        self.copies = copies
        self.sleeper = sleeper
        self.bus: Bus | None = None

    async def register(self, bus: Bus, node: str) -> None:
        self.bus = bus
        await bus.serve(node, Freeze, self.freeze)
        await bus.serve(node, Transfer, self.transfer)
        await bus.serve(node, Reclaim, self.reclaim)
        await bus.serve(node, Thaw, self.thaw)
        await bus.serve(node, ShareWeights, self.share)
        await bus.serve(node, ListLeases, self.list)
        await bus.serve(node, SnapshotLease, self.snapshot)
        await bus.serve(node, SleepEngine, self.sleep_engine)
        await bus.serve(node, FreezeGang, self.freeze_gang)
        await bus.serve(node, ReclaimGang, self.reclaim_gang)

    async def freeze(self, cmd: Freeze) -> FreezeReply:
        async with self.book.lock:
            asleep = [r for r in self.book.records.values() if not cmd.backups_only
                      and r.info.owner == cmd.owner and r.info.state == LeaseState.SLEEPING]
            await self._reclaim_asleep(cmd.owner, asleep)
            recs = [r for r in self.book.records.values() if r.info.owner == cmd.owner and r.info.state in LIVE]
            if not recs and asleep:
                raise NoCommittedWeights(f"{cmd.owner} slept with its weights released on {self.book.settings.node}: "
                                         "nothing to hand on, cold-start (from a node copy or the file)")
            if not recs and (handed := self._handed(cmd)):
                return handed
            if not recs:
                raise NotFound(f"{cmd.owner} holds no live leases on {self.book.settings.node}")
            recs, half = split_for_freeze(recs, cmd.backups_only)
            await self._reclaim_uncommitted(cmd.owner, half)
            if not recs and cmd.backups_only:
                raise NotFound(f"{cmd.owner} holds no committed KV backup on {self.book.settings.node}")
            if not recs:
                raise NoCommittedWeights(f"{cmd.owner} committed no weights on {self.book.settings.node} "
                                         "(killed while loading): nothing to hand on, cold-start from the file")
            frozen = [r for r in recs if r.info.state == LeaseState.FROZEN]
            tokens = {r.transfer_token for r in frozen}
            if len(tokens) == 1 and None not in tokens and not (
                    cmd.promotion and cmd.transfer_token and all(r.info.frozen_for == cmd.incident_id for r in frozen)):
                token = tokens.pop()  # frozen already (a redelivered freeze): the same token
            else:  # else the caller's (a promotion's replaces a freeze of the same incident: Freeze.promotion)
                token = cmd.transfer_token or secrets.token_urlsafe(24)
            cause = f"frozen ({cmd.incident_id or 'no incident'})"
            await self.book.apply_all([Move(r, LeaseEvent.FREEZE, cause, {  # frozen already: for its first incident
                "transfer_token": token,
                "frozen_for": r.info.frozen_for if r.info.state == LeaseState.FROZEN else cmd.incident_id})
                for r in recs])
            reply = self._reply(recs, token)
        await self._announce(MemoryFrozen(owner=cmd.owner, lease_ids=reply.lease_ids, epoch=reply.epoch,
                                          incident_id=cmd.incident_id))
        return reply

    async def thaw(self, cmd: Thaw) -> ThawReply:
        async with self.book.lock:
            recs = [r for r in self.book.records.values()
                    if r.info.state == LeaseState.FROZEN and r.info.frozen_for == cmd.incident_id]
            gone = sorted({r.info.owner for r in recs if not self.book.owner_alive(r)})
            if gone:
                raise Conflict(f"leases frozen for {cmd.incident_id} stay frozen: the process of {', '.join(gone)} "
                               "is gone (they wait for a successor until their deadline)")
            await self.book.apply_all([Move(r, LeaseEvent.THAW, f"thawed ({cmd.incident_id} failed, its owner serves "
                                            "on)", {"transfer_token": None, "frozen_for": None,
                                                                      "successor": None}) for r in recs])
        if recs:
            log.info("thawed %d lease(s) frozen for %s: %s", len(recs), cmd.incident_id,
                     sorted({r.info.owner for r in recs}))
        return ThawReply(lease_ids=[r.id for r in recs])

    async def _announce(self, event: MemoryFrozen) -> None:
        """`memory.frozen`, stored after the lease table's lock is let go (a standby's takeover held until the
        freeze, and every other client of the table, goes on meanwhile: the stream's ack is no wait of theirs), and
        before the freeze's reply, so that no later step of the caller's reaches anyone before it does. A successor
        granted meanwhile reports itself reattached only once it has built its engine; the controller takes a
        reattachment before the freeze as an early successor (incident.py, REATTACHED from FREEZING)."""
        assert self.bus is not None  # set by register(), before any command is served
        try:
            await self.bus.emit(event, incident_id=event.incident_id)
        except Exception as e:  # noqa: BLE001 - the mirror's queue retries it; the freeze itself holds
            log.warning("memory.frozen for %s not published now (%r); queued", event.owner, e)
            self.book.mirror.frozen(event)

    def _unhealthy(self) -> dict[int, str]:
        board = self.book.board
        return dict(board.unhealthy) if board is not None else {}

    def _handed(self, cmd: Freeze) -> FreezeReply | None:
        """The owner's leases frozen for this very incident and taken over since (its node's agent froze them and
        promoted a standby before the control plane's freeze came): the freeze's work is done, said as such. The
        lease rows keep who they were taken from and for what (durable: a restarted manager answers the same)."""
        if cmd.incident_id is None or cmd.backups_only:
            return None
        recs = [r for r in self.book.records.values() if r.info.state in LIVE and r.info.handed_from == cmd.owner
                and r.info.frozen_for == cmd.incident_id]
        if not recs:
            return None
        return self._reply(recs, cmd.transfer_token or secrets.token_urlsafe(24), handed_to=recs[0].info.owner)

    def _reply(self, recs: list[LeaseRecord], token: str | None, handed_to: str | None = None) -> FreezeReply:
        return FreezeReply(lease_ids=[r.id for r in recs], epoch=max(r.info.epoch for r in recs), transfer_token=token,
                           leases=[r.info for r in recs], unhealthy_gpus=self._unhealthy(), handed_to=handed_to)

    async def freeze_gang(self, cmd: FreezeGang) -> FreezeGangReply:
        async with self.book.lock:
            cause = f"frozen with gang {cmd.gang_id} ({cmd.incident_id or 'no incident'})"
            gang, recs, token = await self.gangs.freeze(cmd.gang_id, cmd.transfer_token, cause, cmd.degraded)
        for owner in gang.owners.values():  # each rank's leases, as a plain freeze announces an engine's
            mine = [r for r in recs if r.info.owner == owner]
            if mine:
                await self._announce(MemoryFrozen(owner=owner, lease_ids=[r.id for r in mine],
                                                  epoch=max(r.info.epoch for r in mine), incident_id=cmd.incident_id))
        return FreezeGangReply(gang_id=gang.gang_id, owners=[gang.owners[r] for r in range(gang.size)],
                               generation=gang.generation, transfer_token=token, leases=[r.info for r in recs],
                               unhealthy_gpus=self._unhealthy())

    async def reclaim_gang(self, cmd: ReclaimGang) -> ReclaimGangReply:
        async with self.book.lock:
            return ReclaimGangReply(lease_ids=await self.gangs.reclaim(cmd.gang_id, cmd.force, cmd.group))

    async def _reclaim_uncommitted(self, owner: str, recs: list) -> None:
        """Never offered to a successor: its tensors were not all there (caller holds the lock)."""
        if not recs:
            return
        log.warning("freeze of %s: reclaiming %d uncommitted leases %s", owner, len(recs), [r.id for r in recs])
        await self.book.apply_all([Move(r, LeaseEvent.FORCE_RECLAIM, "uncommitted at freeze") for r in recs])

    async def _reclaim_asleep(self, owner: str, recs: list) -> None:
        """A sleeping lease holds no memory: nothing for a successor, which leases a new KV cache and prefills
        again (the router replays what was in flight; a sleeping engine had nothing in flight). Caller holds the
        lock."""
        if recs:
            log.warning("freeze of %s: reclaiming %d sleeping leases %s", owner, len(recs), [r.id for r in recs])
            await self.book.apply_all([Move(r, LeaseEvent.FORCE_RECLAIM, "asleep at freeze") for r in recs])

    async def sleep_engine(self, cmd: SleepEngine) -> SleepEngineReply:
        return await self.sleeper.ask(cmd)

    async def transfer(self, cmd: Transfer) -> TransferReply:
        async with self.book.lock:
            recs = self.book.frozen_for_transfer(cmd.owner, cmd.transfer_token)

            def name_successor() -> None:
                for rec in recs:
                    rec.successor = cmd.successor

            await self.book.update(recs, name_successor)
            return TransferReply(lease_ids=[r.id for r in recs], epoch=max(r.info.epoch for r in recs))

    async def share(self, cmd: ShareWeights) -> ShareWeightsReply:
        recs = self.book.shareable(cmd.owner)
        if not recs:
            raise NotFound(f"{cmd.owner} holds no committed weight leases on {self.book.settings.node}")
        # One grant per (owner, grantee): asking again (a standby re-shadowing) returns the same token.
        token = next((t for t, pair in self.book.share_grants.items() if pair == (cmd.owner, cmd.grantee)), None)
        if token is None:
            token = secrets.token_urlsafe(24)
            self.book.share_grants[token] = (cmd.owner, cmd.grantee)
        return ShareWeightsReply(share_token=token, lease_ids=[r.id for r in recs], bytes=sum(r.info.size for r in recs))

    async def reclaim(self, cmd: Reclaim) -> ReclaimReply:
        async with self.book.lock:
            rec = self.book.get(cmd.lease_id)
            event = LeaseEvent.FORCE_RECLAIM if cmd.force else LeaseEvent.RECLAIM
            await self.book.apply(rec, event, "reclaimed by command")
            return ReclaimReply(lease=rec.info)

    async def snapshot(self, cmd: SnapshotLease) -> SnapshotReply:
        return await self.copies.snapshot(cmd.lease_id, cmd.artifact, host_tier=cmd.host_tier)

    async def list(self, cmd: ListLeases) -> ListLeasesReply:
        recs = [r.info for r in self.book.records.values()
                if (cmd.owner is None or r.info.owner == cmd.owner) and (cmd.state is None or r.info.state == cmd.state)]
        return ListLeasesReply(leases=recs)
