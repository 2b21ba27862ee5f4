"""A tensor-parallel group's follower ranks (1..N-1), watched by the agent through pidfds of its own.

Rank 0 is the agent's child (its `PidWatcher` entry, keyed by the group's engine id); it starts the followers itself
and names them to the agent as it registers over its link (`followers`: each one's rank, pid and start time;
libs/client/agent_link.py), and the agent keeps them in the group's record (`EngineInfo.followers`). Any process can
be `pidfd_open`ed, so each follower gets a pidfd here: its death is the group's fault the moment the pidfd turns
readable (or the exit poll sees it begin, PF_EXITING), not ~50 ms later when rank 0's `Followers` thread notices and
exits 70, nor later still while rank 0 is stuck in a collective. The followers are not the agent's children: they
are never waited on (rank 0 reaps them); their status is the one their zombie still shows in /proc, else unknown.

Invariants:
1. A follower is watched only under its start time: a pid recycled after the follower's death is never taken for
   it (`PidWatcher.watch` compares the start time read through its own /proc fd).
2. A follower that cannot be watched because it is gone (no such pid, or another process under it) is dead: the
   group's fault (`watch` returns it; a group's followers live exactly as long as the group).
3. The first follower death ends every watch of its group (`forget`); the agent's fault latch (engines.py) keeps
   the group to one `FaultDetected` whichever of its ranks' deaths is seen first, rank 0's exit after it included.
4. The watches of a group end with the group: its rank 0's death (the followers die with it, PR_SET_PDEATHSIG),
   its retirement, or the agent's close.
5. Rank 0's exit 70 (a rank of the group died) seen before a follower's death names the follower all the same when
   the follower is found dead or dying at that moment: on a busy loop both deaths are ready in one pass, and the
   order in which their callbacks run says nothing about which came first.
6. A group the agent kills (its fault, a takeover, a regroup) has every watched follower SIGKILLed through its pidfd
   at once with rank 0 (`kill`): PR_SET_PDEATHSIG fires only at the end of rank 0's exit, after its memory's
   teardown, and a successor taking the gang over waits for every old rank's death.
Where the followers are unknown (a group whose rank 0 does not name them, or whose record an older agent wrote), a
follower's death is seen as before: through rank 0's exit 70.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from libs.common.errors import MalformedMessage
from libs.common.events import FaultKind, RankProcess, rank_engine_id
from services.agent.pidfd import ExitStatus, PidWatcher, known_fault, proc_start_time

log = logging.getLogger("holdfast.agent.ranks")

# (group, the follower, its exit status or None when it was gone before it could be watched, how it was seen)
RankDeath = Callable[[str, RankProcess, ExitStatus | None, str], None]


def parse_followers(raw: Any, tp: int) -> list[RankProcess]:
    """The `followers` a group's rank 0 registers with, checked against the group's `tp`: ranks 1..tp-1, each once,
    in rank order. Raises `MalformedMessage` otherwise (pure)."""
    if not isinstance(raw, list):
        raise MalformedMessage(f"followers must be a list, not {type(raw).__name__}")
    try:
        out = sorted((RankProcess.model_validate(x) for x in raw), key=lambda r: r.rank)
    except ValidationError as e:
        raise MalformedMessage(f"followers {raw!r:.200}: {e}") from None
    if [r.rank for r in out] != list(range(1, tp)):
        raise MalformedMessage(f"a group of {tp} ranks names followers of ranks {[r.rank for r in out]}")
    return out


def death_fault(group: str, rank: RankProcess, st: ExitStatus | None, how: str) -> tuple[FaultKind, str]:
    """The group's fault for a follower's death, its detail naming the rank, its engine id and its pid (pure)."""
    who = f"rank {rank.rank} ({rank_engine_id(group, rank.rank)}, pid {rank.pid})"
    if st is None:
        return FaultKind.KILLED, f"{who} of the group was gone ({how})"
    if st.signal is None and st.exit_code is None:
        return FaultKind.KILLED, f"{who} of the group died ({how}; not the agent's child: its status unknown)"
    kind, what = known_fault(st)
    return kind, f"{who} of the group {'died' if kind is FaultKind.KILLED else 'exited'}: {what} ({how})"


class RankWatch:
    """The watched followers of every group, each by its rank's engine id (`<group>-r<r>`)."""

    def __init__(self, on_death: RankDeath) -> None:
        self._on_death = on_death
        self._watcher = PidWatcher(self._exited, zombie_status=True)
        self._ranks: dict[str, tuple[str, RankProcess]] = {}  # rank engine id -> (its group, its process)

    def watch(self, group: str, followers: list[RankProcess]) -> tuple[list[RankProcess], list[RankProcess]]:
        """Watch `group`'s followers (instead of whatever was watched for it). Returns (the followers as watched, each
        with its start time; those already gone: dead, invariant 2). A follower whose pidfd cannot be opened for
        another reason (out of fds) is left to rank 0's exit 70, as before, and said in the log."""
        self.forget(group)
        watched: list[RankProcess] = []
        gone: list[RankProcess] = []
        for rank in followers:
            key = rank_engine_id(group, rank.rank)
            start = rank.pid_start if rank.pid_start is not None else proc_start_time(rank.pid)
            try:
                if start is None:
                    raise ProcessLookupError(rank.pid)
                self._watcher.watch(key, rank.pid, child=False, start_time=start)
            except ProcessLookupError:
                gone.append(rank)
                continue
            except OSError as e:
                log.warning("cannot watch rank %d of %s (pid %d): %s; its death is seen through rank 0's exit",
                            rank.rank, group, rank.pid, e)
                continue
            self._ranks[key] = (group, rank.model_copy(update={"pid_start": start}))
            watched.append(self._ranks[key][1])
        return watched, gone

    def watching(self, group: str) -> list[RankProcess]:
        return [rank for g, rank in self._ranks.values() if g == group]

    def kill(self, group: str) -> int:
        """SIGKILL every watched follower of `group` through its pidfd (invariant 6); how many were signalled."""
        return sum(self._watcher.signal(key) for key, (g, _) in list(self._ranks.items()) if g == group)

    def dead_follower(self, group: str) -> tuple[RankProcess, ExitStatus] | None:
        """A follower of `group` already dead or dying, looked at now (`PidWatcher.dead_now`): the rank whose death
        made rank 0 exit 70, when the two deaths reach the agent's loop together (invariant 5)."""
        for key, (g, rank) in sorted(self._ranks.items()):
            st = self._watcher.dead_now(key) if g == group else None
            if st is not None:
                return rank, st
        return None

    def forget(self, group: str) -> None:
        """Stop watching `group`'s followers (invariants 3, 4)."""
        for key in [k for k, (g, _) in self._ranks.items() if g == group]:
            del self._ranks[key]
            self._watcher.unwatch(key)
            self._watcher.forget(key)

    def poll_exiting(self) -> list[tuple[str, RankProcess, ExitStatus]]:
        """Followers seen beginning to exit since the last poll (PidWatcher.poll_exiting), with their group."""
        out = []
        for key, st in self._watcher.poll_exiting():
            hit = self._ranks.get(key)
            if hit is not None:
                out.append((hit[0], hit[1], st))
        return out

    def close(self) -> None:
        self._watcher.close()
        self._ranks.clear()

    def _exited(self, key: str, st: ExitStatus) -> None:
        hit = self._ranks.get(key)
        if hit is not None:
            self._on_death(hit[0], hit[1], st, "its pidfd")
