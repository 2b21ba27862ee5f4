"""Engines this agent did not start, or started in an earlier life: adopted into its records, or refused and ended.

- Re-adoption (invariant 6): a restarted agent takes the engines in its node's etcd records back, each watched under
  its pid and start time (a recycled pid is never taken for it); one that died while the agent was away gets its
  fault now; a group's followers are watched again from its record.
- A stranger (an engine that registers unknown: started by someone else, or by a previous agent that died before
  its record reached etcd) is matched to its spec by its model, engine class and version
  (`supervision.stranger_key`) and adopted only while that spec has room for one more of its role
  (`supervision.admit_stranger`); otherwise it is refused with a `conflict` and ended (SIGTERM through a pidfd,
  SIGKILL after `stop_timeout_s`), so that it never runs beside the replacement that took its slot.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

from libs.common.errors import Conflict
from libs.common.events import EngineInfo, EngineRole, EngineStarted, FaultKind, RankProcess
from services.agent import supervision
from services.agent.engines import EngineRecord, State
from services.agent.pidfd import end_process, proc_start_time
from services.agent.protocol import Register
from services.agent.records import RecordWriter
from services.agent.table import EngineTable, FaultReporter

log = logging.getLogger("holdfast.agent")


class Host(EngineTable, FaultReporter, Protocol):
    """What adoption needs of the agent beyond its engine table and faulting: the record writer, retiring an engine
    and watching a group's followers."""

    writer: RecordWriter

    def retire(self, rec: EngineRecord) -> None: ...

    def watch_followers(self, rec: EngineRecord, followers: list[RankProcess]) -> None: ...


class Adoption:
    def __init__(self, host: Host) -> None:
        self.host = host
        self._ending: set[int] = set()  # pids of refused strangers being ended (_end_refused)

    def readopt(self, info: EngineInfo) -> None:
        """An engine of this node's records, at the agent's start (before anyone can register)."""
        host = self.host
        rec = EngineRecord.from_info(info)
        if rec.state in (State.STOPPED, State.STOPPING) or rec.pid is None:
            host.writer.delete_engine(host.node, rec.engine_id)
            return
        host.engines[rec.engine_id] = rec
        try:
            host.watcher.watch(rec.engine_id, rec.pid, child=False, start_time=rec.pid_start)
        except ProcessLookupError:
            log.warning("engine %s (pid %s) died while the agent was away", rec.engine_id, rec.pid)
            host.fault(rec, FaultKind.KILLED, detail="died while the agent was away (status unknown)",
                       died_at=time.time())
            rec.failed_mono = time.monotonic()  # a takeover may still come for an active engine's memory
            if rec.role is EngineRole.STANDBY:
                host.retire(rec)
            return
        if rec.state is State.FAILED:
            rec.failed_mono = time.monotonic()  # restart the takeover wait: nobody counted it while we were down
        # A group's followers, from its record (and again from rank 0's registration when its link reconnects). A
        # record without them (written by an older agent, or rank 0 never named them) leaves a follower's death to
        # rank 0's exit 70, as before this was built.
        host.watch_followers(rec, rec.followers)
        log.info("re-adopted engine %s (pid %d, %s)", rec.engine_id, rec.pid, rec.state.value)

    def adopt(self, reg: Register, pid: int) -> EngineRecord:
        """An engine this agent does not know (a previous agent's child whose record it never wrote, or one started
        by someone else): adopted into its spec, if that spec has room for it (supervision.admit_stranger), else
        refused with a `conflict` and ended, so that it never runs beside the replacement that took its slot."""
        host = self.host
        role = reg.role or EngineRole.ACTIVE
        key = supervision.stranger_key(host.specs, reg.model, reg.engine_class, reg.version)
        spare = role is EngineRole.STANDBY and reg.spare  # a spare says so as it registers
        why = supervision.admit_stranger(host.specs, host.records(), key, role, spare=spare)
        if why is not None:
            self._end_refused(pid)
            raise Conflict(f"engine {reg.engine_id} (pid {pid}) is one too many: {why}")
        start = proc_start_time(pid)
        # a TP group's rank 0 names its followers (watched as it registers, links.py)
        tp = supervision.stranger_tp(host.specs.get(key) if key is not None else None, reg.followers)
        rec = EngineRecord(engine_id=reg.engine_id, model=reg.model, engine_class=reg.engine_class, role=role,
                           gpu=reg.gpu, version=reg.version, spec_key=key, pid=pid, pid_start=start, child=False,
                           tp=tp, spare=spare)
        host.watcher.watch(rec.engine_id, pid, child=False, start_time=start)
        host.engines[rec.engine_id] = rec
        log.info("adopted engine %s (pid %d) started by someone else%s", rec.engine_id, pid,
                 f", into {key}" if key is not None else "")
        host.publish(EngineStarted(engine=host.info(rec)))
        host.save(rec)
        return rec

    def _end_refused(self, pid: int) -> None:
        """End a refused stranger (not our child, so nobody else will): SIGTERM through a pidfd opened now, while
        its registration is in hand (SO_PEERCRED's pid), SIGKILL after `stop_timeout_s`. An engine exits on a
        refused first registration by itself; one refused when it registers again (its link reconnecting after
        our restart, libs/client/agent_link.py) would retry for ever."""
        if pid in self._ending:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        self._ending.add(pid)
        self.host.background(self._ended(pid, fd), f"end-refused:{pid}")

    async def _ended(self, pid: int, fd: int) -> None:
        try:
            if await end_process(fd, self.host.settings.stop_timeout_s):
                log.info("refused engine (pid %d) exited", pid)
            else:
                log.error("refused engine (pid %d) could not be ended (another uid's, or it outlived a SIGKILL)", pid)
        finally:
            self._ending.discard(pid)
