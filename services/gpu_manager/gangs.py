"""The node's gangs (tensor-parallel engines' ranks' leases) and the moves that go through them: register, freeze,
reclaim, take over. The decisions are gang.py's (pure); this module applies them to the lease book.

Invariants (tests/gpu_manager/test_gang_socket.py, tests/engine/test_tp.py):
1. Every move of a gang's leases is one `gang.plan` of the whole gang, applied in one `LeaseBook.apply_all`: every
   lease of every rank moves, or none does.
2. A takeover moves nothing until every rank of the successor group has asked (each on its own connection, so each
   rank's leases get that rank's process as their holder); the last rank's request applies the whole move. A
   rank that does not come within `wait_s` makes the group partial: every waiting rank is refused, nothing moved.
3. A lease of a gang is never taken over alone (`member_of`: the plain takeover refuses it).
4. Gangs are durable (the book's `gangs`, saved with the leases: manager.py invariant 6): a gpu_manager SIGKILLed
   and restarted freezes, hands over and reclaims a gang as before; a registration, a takeover's new owners and
   generation, and a reclaim's end are each written in the commit of the lease rows they go with.
5. A successor group whose every asking rank died (a standby group lost mid-takeover) holds nothing: the next group's
   first request ends it (its waiters refused `partial_gang`) and gathers anew.
6. Degraded (gang.py invariant 10): `freeze(degraded=True)` freezes only every rank's KV backup, and a `degraded`
   takeover gathers the successor's M ranks (not the gang's N) and moves the backups to its rank 0, reclaiming the
   rest of the gang in the same commit; the other ranks get nothing of it.
7. Another uid's gang is unknown to an engine (scope.py, issue 20; tests/gpu_manager/test_gang_scope.py): a
   `gang_takeover` of a gang whose leases are all another uid's gets the `not_found` an unknown gang gets (the same
   line), and a `gang_register` naming a rank whose leases are all another uid's gets the `partial_gang` a rank with
   no leases gets (gang.py's, from the caller's own leases only); the real reason is logged (scope.hidden,
   throttled). A rank engine id whose leases are of both uids (the caller uses another user's engine id) is still
   refused `permission_denied`, as scope.py's rule 2 leaves it. A registration under a gang id a live group holds is
   `conflict` whoever holds it, naming no holder (the ids are the node's, not a uid's: that one is known to exist).
8. A process registers only leases it speaks for (tests/gpu_manager/test_gang_bind.py): its own, every live one of
   its engine id held by it (ACTIVE, its pid: not another process that said hello under its id), and its group's
   ranks' (gang.py invariant 11: rank r is `rank_engine_id(owners[0], r)`, checked before anything is looked up).
   Anything else is `permission_denied` and changes nothing, so no engine binds another's leases into its gang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from typing import Any

from libs.client.protocol import GangRegister, GangTakeover, PredecessorAlive
from libs.common.errors import Conflict, NotFound, PermissionDenied
from libs.common.events import LeaseState, is_kv_backup
from services.gpu_manager.fsm import LIVE, LeaseEvent
from services.gpu_manager.gang import (
    Gang,
    GangMove,
    PartialGang,
    after_degraded,
    after_takeover,
    check_ranks,
    form,
    plan,
    plan_degraded,
    plan_freeze_degraded,
    plan_reclaim,
)
from services.gpu_manager.manager import LeaseBook, Move, check_complete, same_token
from services.gpu_manager.records import LeaseRecord, process_alive
from services.gpu_manager.scope import foreign_owner, hidden

log = logging.getLogger("holdfast.gpu_manager.gangs")


@dataclasses.dataclass
class _Gathering:
    """The ranks of one successor group that have asked so far: rank -> (peer, the future its reply waits on)."""

    successors: list[str]
    generation: int
    token: str
    degraded: bool
    ranks: dict[int, tuple[Any, asyncio.Future[list[LeaseRecord]]]] = dataclasses.field(default_factory=dict)


class GangBook:
    def __init__(self, book: LeaseBook) -> None:
        self.book = book
        self._gathering: dict[str, _Gathering] = {}

    @property
    def gangs(self) -> dict[str, Gang]:
        """The book's gangs (read here; written only through `LeaseBook.apply_all`, with the lease rows)."""
        return self.book.gangs

    def get(self, gang_id: str, peer: Any = None) -> Gang:
        """The gang `gang_id`; asked by an engine (`peer`), `NotFound` alike for an unknown gang and one whose leases
        are all another uid's (invariant 7)."""
        gang = self.gangs.get(gang_id)
        if gang is not None and peer is not None and self._foreign(gang, peer):
            gang = None
        if gang is None:
            raise NotFound(f"no gang {gang_id} on {self.book.settings.node}")
        return gang

    def _foreign(self, gang: Gang, peer: Any) -> bool:
        """Whether the gang's ranks hold leases and none of them is `peer`'s uid's (logged, throttled: scope.py)."""
        uids = {r.owner_uid for r in self._records(gang)}
        if not uids or peer.uid in uids:
            return False
        hidden(f"gang {gang.gang_id}", min(uids), asker=peer.engine_id, uid=peer.uid, pid=peer.pid)
        return True

    def member_of(self, lease_id: str) -> Gang | None:
        return next((g for g in self.gangs.values() if lease_id in g.epochs), None)

    def _leases(self) -> list[Any]:
        return [r.info for r in self.book.records.values()]

    def _records(self, gang: Gang) -> list[LeaseRecord]:
        owners = set(gang.owners.values())
        return [r for r in self.book.records.values() if r.info.owner in owners]

    # ------------------------------------------------------------ under the book's lock

    async def register(self, req: GangRegister, peer: Any) -> Gang:
        """Rank 0's registration once every rank committed (gang.py invariant 6), of its uid's leases only
        (invariant 7) and of those it speaks for (invariant 8). Caller holds the lock."""
        check_ranks(req.gang_id, req.owners)  # the request alone: before anything is looked up
        uid = peer.uid
        hide = {o for o in req.owners
                if foreign_owner(self.book.records, o, asker=peer.engine_id, uid=uid, pid=peer.pid)}
        if any(r.owner_uid != uid for r in self.book.records.values() if r.info.owner in set(req.owners) - hide):
            raise PermissionDenied(f"gang {req.gang_id}: a rank's engine id holds leases of another user")
        self._check_held_by(req.gang_id, peer)
        old = self.gangs.get(req.gang_id)
        if old is not None and set(old.owners.values()) != set(req.owners) and \
                any(r.info.state != LeaseState.RECLAIMED for r in self._records(old)):
            log.warning("gang %s: registration by %s (uid %d) refused: held by %s, whose leases live", req.gang_id,
                        peer.engine_id, uid, list(old.owners.values()))
            raise Conflict(f"gang {req.gang_id} is held by another group, whose leases live")
        # a rank whose leases are another uid's holds none of the caller's: refused as one with none (gang.py's line)
        gang = form(req.gang_id, req.owners, [r.info for r in self.book.records.values() if r.owner_uid == uid])
        if old is not None:
            gang = dataclasses.replace(gang, generation=old.generation)
        await self.book.apply_all([], gangs=[gang])  # durable before the reply
        log.info("gang %s registered: %d ranks %s, %d leases, generation %d", gang.gang_id, gang.size,
                 req.owners, len(gang.epochs), gang.generation)
        return gang

    def _check_held_by(self, gang_id: str, peer: Any) -> None:
        """Rank 0's leases are the calling process's (invariant 8): a process that said hello under a live engine's id
        (or a dead one's, its leases orphaned or frozen) does not speak for them."""
        if any(r.info.state != LeaseState.ACTIVE or r.owner_pid != peer.pid for r in self.book.records.values()
               if r.info.owner == peer.engine_id and r.owner_uid == peer.uid and r.info.state in LIVE):
            log.warning("gang %s: registration by %s (pid %d) refused: its engine id's leases are held by another "
                        "process, or by none", gang_id, peer.engine_id, peer.pid)
            raise PermissionDenied(f"gang {gang_id}: {peer.engine_id}'s leases are not held by this process (pid "
                                   f"{peer.pid}): only the process holding them registers their gang")

    async def freeze(self, gang_id: str, token: str | None, cause: str,
                     degraded: bool = False) -> tuple[Gang, list[LeaseRecord], str]:
        """Every lease of every rank FROZEN under one transfer token (a repeated freeze keeps theirs); `degraded`:
        every rank's KV backup only (invariant 6). Caller holds the lock."""
        gang = self.get(gang_id)
        moves = plan_freeze_degraded(gang, self._leases()) if degraded else plan(gang, self._leases(), LeaseEvent.FREEZE)
        recs = [self.book.records[m.lease_id] for m in moves]
        tokens = {r.transfer_token for r in recs if r.info.state == LeaseState.FROZEN}
        frozen_whole = len(tokens) == 1 and None not in tokens and all(r.info.state == LeaseState.FROZEN for r in recs)
        token = (tokens.pop() if frozen_whole else None) or token or secrets.token_urlsafe(24)
        await self.book.apply_all([Move(r, LeaseEvent.FREEZE, cause, {"transfer_token": token}) for r in recs])
        return gang, recs, token

    async def reclaim(self, gang_id: str, force: bool, group: str | None = None) -> list[str]:
        """Every lease of every rank RECLAIMED (an ACTIVE one only with `force`); the gang ends in the same commit
        (gang.py invariant 7). `group`: only while that engine is its rank 0 (a successor group's gang keeps the
        id: a lost group's clean-up must not take it). Caller holds the lock."""
        gang = self.get(gang_id)
        if group is not None and gang.owners.get(0) != group:
            raise Conflict(f"gang {gang_id} is group {gang.owners.get(0)}'s now (generation {gang.generation}), "
                           f"not {group}'s: nothing reclaimed")
        event = LeaseEvent.FORCE_RECLAIM if force else LeaseEvent.RECLAIM
        moves = plan_reclaim(gang, self._leases(), event)  # whole or not: a broken gang is reclaimed too
        await self.book.apply_all([Move(self.book.records[m.lease_id], event, f"gang {gang_id} reclaimed")
                                   for m in moves])
        return [m.lease_id for m in moves]

    # ------------------------------------------------------------ takeover: the lock only around its checks

    async def takeover(self, req: GangTakeover, peer: Any) -> tuple[Gang | None, list[LeaseRecord]]:
        """Rank `req.rank`'s leases, once every rank of the group has asked (invariant 2)."""
        async with self.book.lock:
            gang = self._check_takeover(req, peer)
            gathering = self._gathering.get(req.gang_id)
            if gathering is not None and not any(_alive(p) for p, _ in gathering.ranks.values()):
                # every rank that asked died (a standby group lost mid-takeover): the group it gathered can never
                # complete, and the group replacing it must not wait out its `wait_s`
                self._fail(req.gang_id, gathering, PartialGang(
                    f"gang {req.gang_id}: the ranks of {gathering.successors} that asked died; nothing moved"))
                gathering = None
            if gathering is None:
                gathering = self._gathering[req.gang_id] = _Gathering(list(req.successors), req.generation,
                                                                      req.transfer_token, req.degraded)
            elif (gathering.successors, gathering.generation, gathering.degraded) != \
                    (list(req.successors), req.generation, req.degraded) or \
                    not same_token(gathering.token, req.transfer_token):
                raise Conflict(f"gang {req.gang_id}: another successor group ({gathering.successors}, generation "
                               f"{gathering.generation}) is gathering")
            if req.rank in gathering.ranks:
                raise Conflict(f"gang {req.gang_id}: rank {req.rank} asked twice")
            done: asyncio.Future[list[LeaseRecord]] = asyncio.get_running_loop().create_future()
            gathering.ranks[req.rank] = (peer, done)
            size = len(gathering.successors) if req.degraded else gang.size
            log.info("gang %s: rank %d of %s asked (%d of %d)%s", req.gang_id, req.rank, gathering.successors,
                     len(gathering.ranks), size, " degraded" if req.degraded else "")
            if len(gathering.ranks) == size:
                await self._move(gang, gathering)
        try:
            recs = await asyncio.wait_for(asyncio.shield(done), req.wait_s)
        except TimeoutError:
            async with self.book.lock:
                if done.done():  # moved while the lock was awaited
                    return self.gangs.get(req.gang_id), done.result()
                missing = sorted(set(range(len(gathering.successors))) - set(gathering.ranks))
                self._fail(req.gang_id, gathering, PartialGang(
                    f"gang {req.gang_id}: ranks {missing} of the successor group did not ask within {req.wait_s} s; "
                    "nothing moved"))
            recs = await done  # raises the refusal
        return self.gangs.get(req.gang_id), recs  # None: a single engine took it over degraded (no gang)

    def _check_takeover(self, req: GangTakeover, peer: Any) -> Gang:
        """What one rank's request can be refused for at once, before it waits (gang.py's checks included)."""
        gang = self.get(req.gang_id, peer)  # another uid's: as an unknown one, before anything else is looked at
        if req.rank >= len(req.successors) or req.successors[req.rank] != peer.engine_id:
            raise PermissionDenied(f"{peer.engine_id} is not rank {req.rank} of the group {req.successors}")
        recs = self._records(gang)
        moves = self._plan(gang, recs, req.successors, req.generation, req.degraded)
        moving = {m.lease_id for m in moves}
        live = [r for r in recs if r.info.id in moving]
        for rec in live:
            if rec.info.id in gang.epochs and not same_token(rec.transfer_token, req.transfer_token) and \
                    (not req.degraded or is_kv_backup(rec.info.name)):
                raise PermissionDenied("wrong transfer token")
            if rec.owner_uid != peer.uid:
                raise PermissionDenied(f"lease {rec.id} belongs to another user")
            if self.book.owner_alive(rec):  # a degraded takeover reclaims the rest: every rank must be gone
                raise PredecessorAlive(f"{rec.info.owner} (pid {rec.owner_pid}) still runs: kill the group first")
        if not req.degraded:
            check_complete(req.gang_id, live)
        return gang

    async def _move(self, gang: Gang, gathering: _Gathering) -> None:
        """The whole group has asked: every rank's leases in one commit (invariant 1). Caller holds the lock."""
        recs = self._records(gang)
        successors = dict(enumerate(gathering.successors))
        # each lease taken over goes to the successor rank its move names (its own rank's; every backup to rank 0 in
        # a degraded takeover: gang.py invariant 10); a degraded takeover's other moves reclaim
        rank_of = {owner: r for r, owner in successors.items()}
        try:
            moves = self._plan(gang, recs, gathering.successors, gathering.generation, gathering.degraded)
            by_id = {r.id: r for r in recs}
            infos = [by_id[m.lease_id].info for m in moves]
            successor_gang = (after_degraded(gang, moves, infos, successors) if gathering.degraded
                              else after_takeover(gang, moves, infos))
            how = "taken over degraded" if gathering.degraded else "taken over"
            await self.book.apply_all([  # the leases' new owners and epochs and the gang's in one commit
                Move(by_id[m.lease_id], m.event, f"gang {gang.gang_id} {how} (rank {m.rank})",
                     _holder(gathering.ranks[rank_of[m.new_owner]][0]) | {"transfer_token": None, "successor": None})
                if m.new_owner is not None else
                Move(by_id[m.lease_id], m.event, f"gang {gang.gang_id} {how} by {gathering.successors}: not needed")
                for m in moves], gangs=[successor_gang] if successor_gang else [],
                drop=[gang.gang_id] if successor_gang is None else [])
        except Exception as e:
            self._fail(gang.gang_id, gathering, e)
            return
        del self._gathering[gang.gang_id]
        for rank, (_, done) in gathering.ranks.items():
            done.set_result([by_id[m.lease_id] for m in moves if m.new_owner is not None and rank_of[m.new_owner] == rank])
        log.info("gang %s taken over by %s: %d leases, generation %d", gang.gang_id, gathering.successors,
                 len(moves), gang.generation + 1)

    @staticmethod
    def _plan(gang: Gang, recs: list[LeaseRecord], successors: list[str], generation: int,
              degraded: bool) -> list[GangMove]:
        infos, tokens = [r.info for r in recs], {r.id: r.transfer_token for r in recs}
        if degraded:
            return plan_degraded(gang, infos, successors=dict(enumerate(successors)), generation=generation,
                                 token_of=tokens)
        return plan(gang, infos, LeaseEvent.TAKEOVER, successors=dict(enumerate(successors)), generation=generation,
                    token_of=tokens)

    def _fail(self, gang_id: str, gathering: _Gathering, why: Exception) -> None:
        if self._gathering.get(gang_id) is gathering:
            del self._gathering[gang_id]
        for _, done in gathering.ranks.values():
            if not done.done():
                done.set_exception(why)


def _alive(peer: Any) -> bool:
    return process_alive(peer.pid, peer.pid_start)


def _holder(peer: Any) -> dict[str, Any]:
    return {"owner": peer.engine_id, "engine_class": peer.engine_class, "owner_pid": peer.pid,
            "owner_pid_start": peer.pid_start}
