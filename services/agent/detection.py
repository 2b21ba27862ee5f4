"""Detection: every observation of an engine's failure becomes its generation's one `FaultDetected`.

Observed here: a process's death (its pidfd; own children reaped with `waitid(P_PIDFD)` for the exit code or signal)
and its coming (PF_EXITING, polled every `exit_poll_ms`), a TP group follower's death (rank_watch.py), heartbeats
overdue (`supervision.overdue`, the agent's own absence credited) and an engine that never connected. Elsewhere,
through `fault()` too: a fatal report (links.py), a stuck HTTP server (probes.py), a GPU's failure (gpu_health.py),
a standby that fails its takeover (takeover.py). `fault()` publishes at most one `FaultDetected` per engine
generation (`latch_fault`), before any etcd write: the detection path is one JetStream publish.

A starting agent holds its faults (`hold_faults`, app.py) until its node key is written (`release_faults`): the
deaths it finds as it re-adopts its engines (adoption.py) and any in its first moments. A control plane that saw such
a fault while `nodes/<node>` was absent (an agent back after its node's etcd lease ran out) took the node for gone:
it skipped the reattach in place onto the live memory and the waiting standby for a cold start elsewhere (probe of
2026-12-07, multi-node finding 4). A held fault's record is written after its publication, as any fault's is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from libs.common.events import FaultDetected, FaultKind, RankProcess
from services.agent import rank_watch, supervision
from services.agent.backoff import Backoffs
from services.agent.engines import EngineRecord, Ev
from services.agent.links import Links
from services.agent.pidfd import ExitStatus, known_fault
from services.agent.rank_watch import RankWatch
from services.agent.table import EngineTable

log = logging.getLogger("holdfast.agent")
GROUP_DIED = 70  # a TP group's rank 0 exits so when another rank died (engines/reference/ranks.py)


class Host(EngineTable, Protocol):
    """What detection needs of the agent beyond its engine table: the followers' watch, the crash-loop backoffs,
    the links (a failed engine's shadows are told), a GPU's UUID, the ready waiters and a process's end."""

    backoffs: Backoffs
    ranks: RankWatch
    links: Links

    def uuid_of(self, gpu: int) -> str | None: ...

    def resolve_ready(self, rec: EngineRecord, exc: BaseException | None = None) -> None: ...

    def gone(self, rec: EngineRecord) -> None: ...

    def promote(self, rec: EngineRecord, kind: FaultKind) -> None: ...


class Detection:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.faults_published = 0
        self._listened_at: float | None = None  # the heartbeat monitor's last pass (monotonic)
        # faults found while held (None: not held), each with its record, published in order once released
        self._held: list[tuple[FaultDetected, EngineRecord]] | None = None

    def hold_faults(self) -> None:
        """From now until `release_faults`, faults are recorded in memory but neither published nor written."""
        if self._held is None:
            self._held = []

    def release_faults(self) -> None:
        """Publish the held faults in the order found, then write their records (those still in the table: a
        retired one's record is gone for good); faults are published at once from now on. Idempotent."""
        held, self._held = self._held, None
        if held:
            log.info("node key written: publishing %d fault(s) found before it", len(held))
        for ev, rec in held or []:
            self._publish(ev)
            if self.host.engines.get(rec.engine_id) is rec:
                self.host.save(rec)

    def _publish(self, ev: FaultDetected) -> None:
        self.host.publish(ev)
        self.faults_published += 1

    def fault(self, rec: EngineRecord, kind: FaultKind, *, exit_code: int | None = None, sig: int | None = None,
              detail: str = "", died_at: float | None = None, rank: int | None = None) -> bool:
        """Publish this generation's one FaultDetected; False when it was already published (or a stop)."""
        if not rec.latch_fault():
            return False
        host = self.host
        if rec.tp > 1:
            # A TP group is one engine to the outside: a follower's death is seen through its own pidfd where rank 0
            # named it (rank_watch.py) and ends rank 0 anyway (GROUP_DIED, engines/reference/ranks.py); the others die with rank 0.
            # So this is the group's one fault, whichever death came first; its incident is the group's.
            detail = f"{detail}; a rank of the group died" if exit_code == GROUP_DIED else detail
        ev = FaultDetected(
            engine_id=rec.engine_id, model=rec.model, engine_class=rec.engine_class, generation=rec.generation,
            pid=rec.pid, kind=kind, exit_code=exit_code, signal=sig, gpu=rec.gpu, gpu_uuid=host.uuid_of(rec.gpu),
            died_at=died_at, detail=detail, role=rec.role, node=host.node,
            group=rec.engine_id if rec.tp > 1 else None, gang=rec.gang, rank=rank)
        held = self._held
        if held is not None:
            held.append((ev, rec))  # its record too: written once the fault is out (release_faults)
        else:
            self._publish(ev)
        host.links.owner_down(rec)
        rec.transition(Ev.FAULT)
        rec.failed_mono = time.monotonic()
        rec.memory_lost = kind.loses_memory  # no takeover can come for it: its slot is not held (supervision.plan)
        if kind.loses_memory:  # but the fallback's successor is coming for a while (supervision.awaits_fallback)
            rec.fallback_until = rec.failed_mono + host.settings.fallback_wait_s
        if rec.spec_key is not None and kind is not FaultKind.GPU_FAULT:
            # a GPU's fault says nothing of the spec's engines: it is not a crash loop of theirs (a node whose GPUs
            # fail one after another would otherwise keep the spec's cold starts waiting on backoffs)
            delay = host.backoffs.failed(rec.spec_key, rec.failed_mono, rec.failed_mono - rec.spawned_mono)
            if delay > 0:
                log.warning("engines of %s keep failing (%d in a row): the next start waits %.1f s",
                            rec.spec_key, host.backoffs.by_key[rec.spec_key].failures, delay)
        log.warning("engine %s: %s %s", rec.engine_id, kind.value, detail)
        host.resolve_ready(rec, RuntimeError(f"engine {rec.engine_id} failed: {kind.value}"))
        if held is None:
            host.save(rec)
        return True

    # ------------------------------------------------------------ deaths: the pidfd, and PF_EXITING before it

    def on_exit(self, engine_id: str, st: ExitStatus) -> None:
        rec = self.host.engines.get(engine_id)
        if rec is None:
            return
        rec.exit_code, rec.signal = st.exit_code, st.signal
        self.follower_first(rec, st)
        if st.known:
            kind, detail = known_fault(st)
        elif rec.said_bye:
            kind, detail = FaultKind.EXITED, "exited after saying goodbye (adopted: exit code unknown)"
        else:
            kind, detail = FaultKind.KILLED, "died without a goodbye (adopted: signal unknown)"
        try:
            if self.fault(rec, kind, exit_code=st.exit_code, sig=st.signal, detail=detail, died_at=st.at):
                self.host.promote(rec, kind)  # its standby at once, where this agent may (takeover.py)
        finally:
            self.host.gone(rec)  # the process is gone whatever became of its fault: its link and waiters end

    def exiting(self, engine_id: str, st: ExitStatus) -> None:
        """Seen exiting (PF_EXITING) before the pidfd says dead: the fault is published now. The process can
        no longer run code, but its memory is still mapped until the death: fencing waits for the pidfd."""
        rec = self.host.engines.get(engine_id)
        if rec is None or not rec.live or rec.said_bye:
            return  # a goodbye before the exit: its own clean stop, reported by the pidfd as usual
        if self.follower_first(rec, st):
            return
        kind, detail = known_fault(st)
        if self.fault(rec, kind, exit_code=st.exit_code, sig=st.signal, detail=f"{detail} (seen exiting: {st.seen})",
                      died_at=st.at):
            self.host.promote(rec, kind)

    def follower_first(self, rec: EngineRecord, st: ExitStatus) -> bool:
        """A group's rank 0 exiting 70 because a follower died: the follower's death is the fault, published now
        if it is found dead or dying (rank_watch.py invariant 5). True when it was."""
        if rec.tp <= 1 or st.exit_code != GROUP_DIED:
            return False
        hit = self.host.ranks.dead_follower(rec.engine_id)
        if hit is None:
            return False
        self.rank_died(rec.engine_id, hit[0], hit[1], "found dead as rank 0 exited")
        return True

    async def exiting_loop(self) -> None:
        period = self.host.settings.exit_poll_ms / 1000.0
        while True:
            await asyncio.sleep(period)
            for engine_id, st in self.host.watcher.poll_exiting():
                self.exiting(engine_id, st)
            for group, rank, st in self.host.ranks.poll_exiting():
                self.rank_died(group, rank, st, "seen exiting")

    # ------------------------------------------------------------ a TP group's followers

    def watch_followers(self, rec: EngineRecord, followers: list[RankProcess]) -> None:
        """Watch a live group's followers through pidfds of the agent's own (rank_watch.py); one already gone is the
        group's fault now. Kept in its record, so that a restarted agent watches them again."""
        if rec.tp <= 1 or not rec.live or not followers:
            return
        watched, gone = self.host.ranks.watch(rec.engine_id, followers)
        known = {r.rank: r for r in [*followers, *watched]}  # with the start times read as they were watched
        named = [known[r] for r in sorted(known)]
        if named != rec.followers:
            rec.followers = named
            self.host.save(rec)
        if gone:
            self.rank_died(rec.engine_id, gone[0], None, "gone when the agent came to watch it")

    def rank_died(self, group: str, rank: RankProcess, st: ExitStatus | None, how: str) -> None:
        """A follower of `group` died: the group's one fault, published now, as for rank 0's death. Rank 0 still runs
        (it exits 70 ~50 ms later, or dies at the takeover's kill); its exit then adds no fault (the latch), and the
        fault's `exit_code` and `signal` stay None (they are rank 0's; the detail names the follower's)."""
        self.host.ranks.forget(group)  # the first death ends the group's watches (rank_watch.py invariant 3)
        rec = self.host.engines.get(group)
        if rec is None or not rec.live or rec.said_bye:
            return  # stopping, or a goodbye said: rank 0's own exit is reported by its pidfd as usual
        kind, detail = rank_watch.death_fault(group, rank, st, how)
        self.fault(rec, kind, detail=detail, died_at=st.at if st is not None else time.time(), rank=rank.rank)

    # ------------------------------------------------------------ hangs: heartbeats overdue, never connected

    def check_heartbeats(self, now: float, period: float) -> None:
        """Every `period`: the engines silent past their timeout are hung, the agent's own absence not counted
        (a 12 s SIGSTOP of the agent once declared every engine of the node hung the moment it ran again, their
        heartbeats of those 12 s still unread in its sockets)."""
        settings, records = self.host.settings, self.host.records
        absent = 0.0 if self._listened_at is None else now - self._listened_at - period
        self._listened_at = now
        if absent > period:  # more than a pass late: this agent was not running
            supervision.credit_absence(records(), absent, now)
            if absent > settings.heartbeat_timeout_s / 2:
                log.warning("the agent did not run for %.3f s: engines' heartbeat deadlines moved on by as much",
                            absent)
        for rec in supervision.overdue(records(), now, settings.heartbeat_timeout_s,
                                       settings.start_heartbeat_timeout_s):
            late = now - (rec.last_heartbeat or now)
            self.fault(rec, FaultKind.HUNG, detail=f"no heartbeat for {late:.3f}s", died_at=time.time())
        for rec in supervision.never_linked(records(), now, self.host.specs):
            self.fault(rec, FaultKind.HUNG, detail="never connected to the agent", died_at=time.time())

    async def monitor_loop(self) -> None:
        """Heartbeat deadlines, checked often enough that a hang is seen within timeout + 1/10 of it."""
        period = max(0.01, min(0.1, self.host.settings.heartbeat_timeout_s / 10))
        while True:
            await asyncio.sleep(period)
            self.check_heartbeats(time.monotonic(), period)
