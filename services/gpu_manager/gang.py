"""Gangs: the leases of a tensor-parallel engine's N ranks move as one. Pure: no I/O (issue 22, part 2).

A tensor-parallel engine is N rank processes, each holding its own shard's leases (weights, KV). A successor group
can only run if it gets every rank's shard, each at the generation the group last committed; half a group's
memory is useless and a rank's memory from an older generation is wrong. So a gang's leases are frozen,
transferred (taken over) and reclaimed together, checked as a whole before any lease moves:

Invariants (tests/gpu_manager/test_gang.py):
1. All or nothing: `plan` returns a move for every lease of every rank, or raises and moves none (the caller
   applies the moves in one transaction: LeaseBook.apply_all).
2. Partial: a gang missing a rank's leases (or a rank with no weights), or a successor group that does not name
   exactly the ranks 0..N-1, is refused with `PartialGang` (code `partial_gang`).
3. Stale: a lease whose epoch is not the one the gang recorded for it (a rank restarted or taken over alone
   since), a successor asking with another gang generation than the current one, or ranks frozen under
   different transfer tokens, is refused with `StaleGang` (code `stale_gang`).
4. Every move is one the lease state machine allows (fsm.transition); one refused move refuses the gang.
5. A takeover bumps the gang's generation by one; the successor's ranks own their predecessors' shards rank for
   rank.
6. A gang is formed (`form`) only from committed leases: every rank's live leases committed, weights among them;
   its epochs are those leases' epochs then.
7. A gang lasts exactly as long as one of its leases is held (`ended`): the move that reclaims its last lease ends
   it, in the same commit.
8. A reclaim needs no whole gang (`plan_reclaim`): every lease of it still held goes, whole, partial or stale (a
   rank's memory lost on a GPU fault leaves the others nothing to serve); only a refused move refuses it. A gang
   that lost a committed lease is `broken`: no successor group can ever take it over.
9. Except a KV cache backed up to host: committed leases gone are not a loss (the gang stays whole and takeable,
   not broken) while as many ranks hold their weights and a KV backup (`is_kv_backup`) but no KV cache
   (`restorable`). Each rank commits one KV cache, so those are the caches gone; the successor group restores them
   from the backups (engines/batched/backup.py) and registers the gang anew with its new caches.
10. Degraded (FailSafe's core, `plan_degraded`): a gang that lost a rank's GPU memory (broken) while every rank
   still holds its KV backup (host memory, taken by no GPU fault: `degradable`) can be taken over by a group of
   M < N ranks, on the GPUs left (or, a degraded group's own gang once the GPUs are back, by a whole group of M > N
   ranks: a regroup, the same moves): every rank's backup goes to the successor's rank 0, which restores each
   sequence's cache from all N, re-sharded by kv head for its own group (engines/batched/degrade.py); every other
   lease of the gang (the surviving ranks' weights and caches, useless to a group sharded otherwise) is reclaimed
   in the same commit, so the successor's new weights find the room on those GPUs. The same checks as a takeover:
   the successor names ranks 0..M-1, asks at the current generation, and every backup is frozen under one token at
   its committed epoch. The gang the successor holds is its own (size M; none for M = 1: a single engine is no
   gang), registered anew once its ranks commit.
11. A gang's ranks are one group's processes: rank r > 0 is `rank_engine_id(owners[0], r)` (`check_ranks`), the id its
   rank 0 starts it under (engines/batched/tp_group.py, engines/reference/tp_runner.py) and that no other engine is
   given (the agent's ids are `new_id`'s, which never end `-r<n>`). So rank 0 names only its own group's ranks: no
   other engine's leases are bound into its gang (that engine's own failover would be refused `partial_gang`, and a
   freeze of this gang would freeze its live leases).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from libs.client.protocol import GangView, PartialGang, StaleGang
from libs.common.errors import PermissionDenied
from libs.common.events import LeaseInfo, LeaseState, Tag, is_kv_backup, rank_engine_id
from services.gpu_manager.fsm import LIVE, LeaseEvent, transition

__all__ = ["Gang", "GangMove", "PartialGang", "StaleGang", "after_degraded", "after_takeover", "belongs", "broken",
           "check_ranks", "degradable", "ended", "form", "plan", "plan_degraded", "plan_reclaim", "restorable"]


@dataclass(frozen=True)
class Gang:
    """One tensor-parallel engine's ranks: rank -> engine id (a rank's process), and the epoch of each lease as
    of the gang's last commit (lease id -> epoch). `generation` grows by one with each takeover."""

    gang_id: str
    size: int
    owners: Mapping[int, str]
    epochs: Mapping[str, int] = field(default_factory=dict)
    generation: int = 1

    def rank_of(self, owner: str) -> int | None:
        return next((r for r, o in self.owners.items() if o == owner), None)

    def view(self) -> GangView:
        return GangView(gang_id=self.gang_id, owners=[self.owners[r] for r in range(self.size)],
                        epochs=dict(self.epochs), generation=self.generation)


@dataclass(frozen=True)
class GangMove:
    lease_id: str
    rank: int
    event: LeaseEvent
    new_owner: str | None = None  # a takeover: the successor rank's engine id


def belongs(gang: Gang, info: LeaseInfo) -> bool:
    """A lease is the gang's if the gang committed it, or a rank of the gang holds it (one allocated since: it
    makes the gang partial, but it goes with the gang)."""
    return info.id in gang.epochs or gang.rank_of(info.owner) is not None


def ended(gangs: Iterable[Gang], leases: Iterable[LeaseInfo]) -> list[str]:
    """The gangs none of whose leases is held any more (invariant 7): `leases` are every row not reclaimed."""
    held = [i for i in leases if i.state != LeaseState.RECLAIMED]
    return [g.gang_id for g in gangs if not any(belongs(g, i) for i in held)]


def broken(gang: Gang, leases: Iterable[LeaseInfo]) -> bool:
    """A lease the gang committed is no longer held (reclaimed: its memory lost, released, or its deadline) and no
    rank's KV backup stands for it: the gang is partial for good (invariants 8 and 9)."""
    held = [i for i in leases if i.state != LeaseState.RECLAIMED]
    ids = {i.id for i in held}
    return sum(lease_id not in ids for lease_id in gang.epochs) > restorable(members(gang, held))


def restorable(by_rank: Mapping[int, list[LeaseInfo]]) -> int:
    """How many ranks lost their KV cache but hold its host backup and their weights (invariant 9)."""
    return sum(1 for infos in by_rank.values() if any(i.tag == Tag.WEIGHTS for i in infos)
               and any(is_kv_backup(i.name) for i in infos) and not any(i.tag == Tag.KV_CACHE for i in infos))


def plan_reclaim(gang: Gang, leases: Sequence[LeaseInfo], event: LeaseEvent) -> list[GangMove]:
    """`event` (RECLAIM, FORCE_RECLAIM) for every held lease of the gang, or InvalidTransition and no move
    (invariant 8): an ACTIVE lease refuses a RECLAIM, so an unforced reclaim never takes a running rank's memory."""
    moves = []
    for info in leases:
        if info.state != LeaseState.RECLAIMED and belongs(gang, info):
            transition(info.state, event)
            moves.append(GangMove(info.id, gang.rank_of(info.owner) or 0, event))
    return moves


def members(gang: Gang, leases: Sequence[LeaseInfo]) -> dict[int, list[LeaseInfo]]:
    """Each rank's live leases (a rank with none is listed empty)."""
    out: dict[int, list[LeaseInfo]] = {r: [] for r in range(gang.size)}
    for info in leases:
        rank = gang.rank_of(info.owner)
        if rank is not None and info.state in LIVE:
            out[rank].append(info)
    return out


def check_ranks(gang_id: str, owners: Sequence[str]) -> None:
    """Refuse ranks that are not one group's (invariant 11): another engine's id among them would bind its leases."""
    group = [rank_engine_id(owners[0], r) for r in range(len(owners))]
    if list(owners) != group:
        raise PermissionDenied(f"gang {gang_id}: ranks {list(owners)} are not {owners[0]}'s group {group}: a gang "
                               "holds only its own group's leases")


def form(gang_id: str, owners: Sequence[str], leases: Sequence[LeaseInfo]) -> Gang:
    """A new gang: rank r is `owners[r]`, its epochs those of every rank's live leases now (invariant 6)."""
    if not owners or len(set(owners)) != len(owners):
        raise PartialGang(f"gang {gang_id}: ranks {list(owners)} must name each engine once")
    gang = Gang(gang_id, len(owners), dict(enumerate(owners)))
    by_rank = members(gang, leases)
    half = [i.id for infos in by_rank.values() for i in infos if i.layout_hash is None]
    if half:
        raise PartialGang(f"gang {gang_id}: leases {half} are not committed: every rank commits before the gang forms")
    gang = replace(gang, epochs={i.id: i.epoch for infos in by_rank.values() for i in infos})
    check_whole(gang, by_rank)
    return gang


def check_whole(gang: Gang, by_rank: Mapping[int, list[LeaseInfo]]) -> None:
    """Refuse a partial or stale gang (invariants 2 and 3)."""
    if sorted(gang.owners) != list(range(gang.size)):
        raise PartialGang(f"gang {gang.gang_id} names ranks {sorted(gang.owners)}, not 0..{gang.size - 1}")
    for rank, infos in by_rank.items():
        if not infos:
            raise PartialGang(f"gang {gang.gang_id}: rank {rank} ({gang.owners[rank]}) holds no live leases")
        if not any(i.tag == Tag.WEIGHTS for i in infos):
            raise PartialGang(f"gang {gang.gang_id}: rank {rank} holds no weights")
        for info in infos:
            want = gang.epochs.get(info.id)
            if want is None:
                raise PartialGang(f"gang {gang.gang_id}: lease {info.id} of rank {rank} is not in the gang's commit")
            if info.epoch != want:
                raise StaleGang(f"gang {gang.gang_id}: lease {info.id} of rank {rank} is at epoch {info.epoch}, "
                                f"the gang committed it at {want}")
    missing = set(gang.epochs) - {i.id for infos in by_rank.values() for i in infos}
    if len(missing) > restorable(by_rank):  # invariant 9: a cache backed up to host is not missed
        raise PartialGang(f"gang {gang.gang_id}: committed leases {sorted(missing)} are gone")


def plan(gang: Gang, leases: Sequence[LeaseInfo], event: LeaseEvent, *, successors: Mapping[int, str] | None = None,
         generation: int | None = None, token_of: Mapping[str, str | None] | None = None) -> list[GangMove]:
    """The moves of `event` (FREEZE, TAKEOVER, RECLAIM, FORCE_RECLAIM, DEADLINE) for the whole gang, or a typed
    error and no move. A takeover needs `successors` (rank -> engine id, every rank), the gang `generation` the
    successor group was told (the current one), and each lease's transfer token (`token_of`: all the same)."""
    by_rank = members(gang, leases)
    check_whole(gang, by_rank)
    if event is LeaseEvent.TAKEOVER:
        _check_takeover(gang, by_rank, successors, generation, token_of or {})
    moves = []
    for rank, infos in sorted(by_rank.items()):
        for info in infos:
            transition(info.state, event)  # raises InvalidTransition: the whole gang is refused (invariant 4)
            moves.append(GangMove(info.id, rank, event, (successors or {}).get(rank)
                                  if event is LeaseEvent.TAKEOVER else None))
    return moves


def _check_takeover(gang: Gang, by_rank: Mapping[int, list[LeaseInfo]], successors: Mapping[int, str] | None,
                    generation: int | None, token_of: Mapping[str, str | None]) -> None:
    if successors is None or sorted(successors) != list(range(gang.size)):
        got = sorted(successors or {})
        raise PartialGang(f"gang {gang.gang_id} has {gang.size} ranks; the successor group has ranks {got}")
    if generation != gang.generation:
        raise StaleGang(f"gang {gang.gang_id} is at generation {gang.generation}; the successor group asked for "
                        f"{generation}")
    not_frozen = [i.id for infos in by_rank.values() for i in infos if i.state != LeaseState.FROZEN]
    if not_frozen:
        raise PartialGang(f"gang {gang.gang_id}: leases {not_frozen} are not frozen: the gang is frozen whole first")
    tokens = {token_of.get(i.id) for infos in by_rank.values() for i in infos}
    if len(tokens) != 1 or None in tokens:
        raise StaleGang(f"gang {gang.gang_id}: its ranks were frozen under different transfer tokens")


def after_takeover(gang: Gang, moves: Sequence[GangMove], leases: Sequence[LeaseInfo]) -> Gang:
    """The gang the successor group holds (invariant 5): its engine ids, each lease's new epoch, generation + 1."""
    old = {i.id: i.epoch for i in leases}
    owners = {m.rank: m.new_owner or gang.owners[m.rank] for m in moves}
    epochs = {m.lease_id: old[m.lease_id] + (1 if transition(LeaseState.FROZEN, m.event).bump_epoch else 0)
              for m in moves}
    return Gang(gang.gang_id, gang.size, owners, epochs, gang.generation + 1)


def backups(gang: Gang, leases: Sequence[LeaseInfo]) -> dict[int, LeaseInfo]:
    """Each rank's KV backup lease still held, of those the gang committed (a rank without one is not listed)."""
    out: dict[int, LeaseInfo] = {}
    for info in leases:
        rank = gang.rank_of(info.owner)
        if rank is not None and info.state in LIVE and info.id in gang.epochs and is_kv_backup(info.name):
            out[rank] = info
    return out


def degradable(gang: Gang, leases: Sequence[LeaseInfo]) -> bool:
    """Every rank's committed KV backup is held at the epoch the gang committed it (invariant 10)."""
    held = backups(gang, leases)
    return len(held) == gang.size and all(gang.epochs[i.id] == i.epoch for i in held.values())


def plan_freeze_degraded(gang: Gang, leases: Sequence[LeaseInfo]) -> list[GangMove]:
    """FREEZE for every rank's backup of a degradable gang (what a degraded takeover moves), or a typed error."""
    if not degradable(gang, leases):
        raise PartialGang(f"gang {gang.gang_id}: not every rank holds its KV backup at its committed epoch: a "
                          "degraded group would have no cache to restore")
    moves = []
    for rank, info in sorted(backups(gang, leases).items()):
        transition(info.state, LeaseEvent.FREEZE)
        moves.append(GangMove(info.id, rank, LeaseEvent.FREEZE))
    return moves


def plan_degraded(gang: Gang, leases: Sequence[LeaseInfo], *, successors: Mapping[int, str], generation: int,
                  token_of: Mapping[str, str | None]) -> list[GangMove]:
    """A degraded takeover's moves (invariant 10): every rank's backup to the successor's rank 0, every other lease
    of the gang reclaimed; or a typed error and no move."""
    size = len(successors)
    if sorted(successors) != list(range(size)):
        raise PartialGang(f"gang {gang.gang_id}: a successor group names its ranks 0..M-1, not {sorted(successors)}")
    if generation != gang.generation:
        raise StaleGang(f"gang {gang.gang_id} is at generation {gang.generation}; the successor group asked for "
                        f"{generation}")
    held = backups(gang, leases)
    if len(held) != gang.size:
        missing = sorted(set(range(gang.size)) - set(held))
        raise PartialGang(f"gang {gang.gang_id}: ranks {missing} hold no KV backup: nothing to restore their heads from")
    for rank, info in held.items():
        if info.epoch != gang.epochs[info.id]:
            raise StaleGang(f"gang {gang.gang_id}: backup {info.id} of rank {rank} is at epoch {info.epoch}, the "
                            f"gang committed it at {gang.epochs[info.id]}")
    not_frozen = [i.id for i in held.values() if i.state != LeaseState.FROZEN]
    if not_frozen:
        raise PartialGang(f"gang {gang.gang_id}: backups {not_frozen} are not frozen: freeze the gang degraded first")
    tokens = {token_of.get(i.id) for i in held.values()}
    if len(tokens) != 1 or None in tokens:
        raise StaleGang(f"gang {gang.gang_id}: its backups were frozen under different transfer tokens")
    moves = []
    for rank, info in sorted(held.items()):
        transition(info.state, LeaseEvent.TAKEOVER)
        moves.append(GangMove(info.id, rank, LeaseEvent.TAKEOVER, successors[0]))
    taken = {i.id for i in held.values()}
    for info in leases:
        if info.state != LeaseState.RECLAIMED and info.id not in taken and belongs(gang, info):
            transition(info.state, LeaseEvent.FORCE_RECLAIM)  # the caller checked every rank is gone
            moves.append(GangMove(info.id, gang.rank_of(info.owner) or 0, LeaseEvent.FORCE_RECLAIM))
    return moves


def after_degraded(gang: Gang, moves: Sequence[GangMove], leases: Sequence[LeaseInfo],
                   successors: Mapping[int, str]) -> Gang | None:
    """The gang a degraded group holds until it registers its own (invariant 10): its ranks, the backups at their
    new epochs; None for a single successor engine."""
    if len(successors) == 1:
        return None
    old = {i.id: i.epoch for i in leases}
    epochs = {m.lease_id: old[m.lease_id] + 1 for m in moves if m.event is LeaseEvent.TAKEOVER}
    return Gang(gang.gang_id, len(successors), dict(successors), epochs, gang.generation + 1)
