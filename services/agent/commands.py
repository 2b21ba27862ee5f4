"""The node's plain commands: `spawn` (a spec deployed; or, on an incident's behalf, a cold start, a reattaching or
backup-taking successor, a spare assigned), `stop` (one fewer of its kind) and `list`. A takeover is takeover.py's,
`mark_gpu` gpu_health.py's.

A spawn naming neither an engine nor an incident deploys its spec: it becomes the node's desired state for its key.
One on an incident's behalf (the dc_manager's cold start, maybe for another node's engine) changes the node's spec
only once its engine is admitted and started here, and then keeps the node's own counts (`spec_after_cold_start`).

A fallback's spawn that names a spare (`Spawn.spare`: a standby on another GPU with its own weights loaded,
EngineSpec.spares) assigns it rather than starting a process: it takes the predecessor's KV backup over
(`backup_of`) or, none, serves afresh, and the reply waits for it to say ready (its start is done: it serves within
its assignment's time). A spare gone, assigned meanwhile, on a GPU that failed since, or failing on the way: a cold
engine is started as without one. Idempotent by incident, as takeovers are.

A stop the controller stamped with its leader term (`StopEngine.term`) runs only while that term leads: one
linearizable etcd read per stamped stop, and one of an ended term is refused (`stale_term`, logged, the engine and
its spec untouched: libs/common/terms.py). An unstamped stop (an operator's, a tool's) is not checked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from libs.common.errors import StaleTerm
from libs.common.events import (
    EngineRole,
    EngineSpec,
    FaultKind,
    ListEngines,
    ListEnginesReply,
    RestartBackoff,
    Spawn,
    SpawnReply,
    StopEngine,
    StopReply,
)
from libs.common.terms import refusal
from services.agent.engines import LIVE, EngineRecord, Ev
from services.agent.gpu_health import GpuHealth
from services.agent.pidfd import ExitStatus
from services.agent.records import RecordWriter
from services.agent.starts import Starts
from services.agent.supervision import pick_spare, spec_after_cold_start, spec_key
from services.agent.table import EngineTable

log = logging.getLogger("holdfast.agent")


class Host(EngineTable, Protocol):
    """What the commands need of the agent beyond its engine table: admission (`starts`), the record writer (the
    specs), an engine by id, starting and stopping one, a reconcile pass and the crash-loop backoffs' report."""

    starts: Starts
    writer: RecordWriter
    gpu_health: GpuHealth

    def get(self, engine_id: str) -> EngineRecord: ...

    async def assign(self, rec: EngineRecord, msg: dict[str, Any]) -> None: ...

    async def wait_ready(self, engine_id: str, within_s: float) -> EngineRecord: ...

    def fault(self, rec: EngineRecord, kind: FaultKind, *, exit_code: int | None = None, sig: int | None = None,
              detail: str = "", died_at: float | None = None, rank: int | None = None) -> bool: ...

    def start_engine(self, key: str, role: EngineRole, *, engine_id: str | None = None, generation: int = 0,
                     extra_env: dict[str, str] | None = None, spec: EngineSpec | None = None,
                     replacing: EngineRecord | None = None, gang: str | None = None,
                     same_gpu: bool = True) -> EngineRecord: ...

    async def stop(self, engine_id: str) -> int | None: ...

    async def kill_confirmed(self, rec: EngineRecord, within_s: float = 5.0) -> ExitStatus | None: ...

    def retire(self, rec: EngineRecord) -> None: ...

    def reconcile_soon(self) -> None: ...

    def backoff_report(self) -> list[RestartBackoff]: ...


class Commands:
    def __init__(self, host: Host, term_now: Callable[[], Awaitable[int]]) -> None:
        self.host = host
        self.term_now = term_now  # the controller's term in etcd now (0: nobody leads): libs/common/terms.py
        self.refused = 0  # stops of a controller term that had ended
        self._spares: dict[str, asyncio.Task[EngineRecord | None]] = {}  # incident -> its spare's assignment

    async def spawn(self, cmd: Spawn) -> SpawnReply:
        host = self.host
        key = spec_key(cmd.spec)
        if cmd.reattach_from is not None:
            # dc_manager's cold-start fallback: one process that reattaches the named engine's leases.
            extra = {"HF_TAKEOVER_FROM": cmd.reattach_from, "HF_TRANSFER_TOKEN": cmd.transfer_token or "",
                     "HF_INCIDENT_ID": cmd.incident_id or ""}
            rec = host.start_engine(key, EngineRole.ACTIVE, engine_id=cmd.engine_id, spec=cmd.spec, extra_env=extra,
                                    replacing=host.engines.get(cmd.reattach_from))
            return SpawnReply(engine=host.info(rec))
        if cmd.backup_of is not None:
            # dc_manager's fallback for an engine whose weights and cache were lost with their GPU, or its regroup of
            # a degraded engine: an engine (or group) that takes that engine's KV backup over and loads its weights
            # itself (engines/batched/memory.py `takeover`, tp_group.py `load`)
            if not cmd.transfer_token:
                raise ValueError("a spawn from a KV backup needs its transfer token")
            return await self._successor(cmd, key, cmd.backup_of, {
                "HF_TAKEOVER_FROM": cmd.backup_of, "HF_TRANSFER_TOKEN": cmd.transfer_token})
        if cmd.degrade_gang is not None:
            # dc_manager's degraded fallback: fewer ranks in a lost group's place, from its ranks' KV backups (or,
            # a regroup, a whole group in a degraded group's place); the spec kept is the group's (nothing
            # recorded: a spec's own starts stay whole groups)
            if not cmd.transfer_token or cmd.gang_generation is None:
                raise ValueError("a degraded spawn needs the gang's transfer token and generation")
            return await self._successor(cmd, key, cmd.predecessor or "", {
                "HF_DEGRADE_GANG": cmd.degrade_gang, "HF_TRANSFER_TOKEN": cmd.transfer_token,
                "HF_GANG_GENERATION": str(cmd.gang_generation)}, gang=cmd.degrade_gang)
        if cmd.engine_id is not None and cmd.engine_id in host.engines:
            return SpawnReply(engine=host.info(host.engines[cmd.engine_id]))  # a repeated spawn: the one started
        if cmd.spare is not None:
            spare = await self._on_spare(cmd, key, None)  # a fallback's successor afresh (no backup to continue)
            if spare is not None:
                return SpawnReply(engine=host.info(spare))
        host.starts.admit_fresh_start(key)  # a crash-looping spec's cold start waits out its backoff too
        if cmd.engine_id is None and cmd.incident_id is None:
            return self._deploy(cmd, key)
        return self._cold_start(cmd, key)

    def _deploy(self, cmd: Spawn, key: str) -> SpawnReply:
        """A spec deployed (a Spawn on nobody's behalf): this node's desired state for its key becomes the sent
        spec (the GPUs it named before kept after the sent ones); an active engine is started now if fewer than its
        `replicas` run, and the reconciler adds the standbys and further replicas."""
        host = self.host
        spec, old = cmd.spec, host.specs.get(key)
        if old is not None:
            spec = spec.model_copy(update={"gpus": list(dict.fromkeys([*spec.gpus, *old.gpus]))})
        host.specs[key] = spec
        host.writer.put_spec(host.node, key, spec)
        actives = [r for r in host.records()
                   if r.spec_key == key and r.role is EngineRole.ACTIVE and r.state in LIVE]
        if len(actives) < spec.replicas or not actives:
            rec = host.start_engine(key, EngineRole.ACTIVE, spec=cmd.spec)
        else:
            rec = actives[0]
        host.reconcile_soon()
        return SpawnReply(engine=host.info(rec))

    def _cold_start(self, cmd: Spawn, key: str) -> SpawnReply:
        """A cold start on an incident's behalf (the dc_manager's fallback: `engine_id` names it), maybe for another
        node's engine: one active engine on the GPU the sent spec names, admitted against this node's own spec
        (`start_engine`: supervision.admit_active). The node's spec changes only once the engine is started, and
        then only as far as `supervision.spec_after_cold_start` says (the GPU it runs on; no spec before: the sent one
        for this one replica): a refused or failed start leaves it as it was (probe of 2026-12-07, multi-node finding
        3: another node's spec stored by a refused cold start stopped this node's warm standby; one naming a GPU this
        node lacks stayed, reloaded at every restart)."""
        host = self.host
        own = host.specs.get(key)
        if own is not None and own.replicas == 0:
            # a spec that wants none here (its replica moved away: a stop is one fewer) takes one back as an empty
            # node would (the lost-node pass stops a replaced engine when its node returns: then its replacement's
            # node died, and this one refused the next cold start, the model unserved; probe of 2026-12-07)
            own = own.model_copy(update={"replicas": 1})
            host.specs[key] = own
            try:
                rec = host.start_engine(key, EngineRole.ACTIVE, engine_id=cmd.engine_id, spec=cmd.spec)
            except Exception:
                host.specs[key] = own.model_copy(update={"replicas": 0})  # refused or failed: as it was
                raise
            host.writer.put_spec(host.node, key, own)
        else:
            rec = host.start_engine(key, EngineRole.ACTIVE, engine_id=cmd.engine_id, spec=cmd.spec)
        spec = spec_after_cold_start(own, cmd.spec)
        if spec != own:
            host.specs[key] = spec
            host.writer.put_spec(host.node, key, spec)
        host.reconcile_soon()  # its standbys
        return SpawnReply(engine=host.info(rec))

    async def _successor(self, cmd: Spawn, key: str, predecessor: str, orders: dict[str, str],
                         gang: str | None = None) -> SpawnReply:
        """An engine (or group) in `predecessor`'s slot on the GPUs its spec names, which takes the predecessor's KV
        backups over (`orders`: its environment) and loads its weights itself. A predecessor still serving (a
        regroup) is stopped first and its death confirmed, as a takeover's is (kill-before-transfer): the backups are
        read only once nothing writes them; its slot stays held meanwhile (`handing_over`), so no replica is started
        for it. `gang`: the gang id a group of several ranks registers (a degraded group keeps its broken gang's, so
        that the group's record names the gang its incidents freeze). A repeated spawn (the same engine id) answers
        the engine started."""
        host = self.host
        if cmd.engine_id is not None and cmd.engine_id in host.engines:
            return SpawnReply(engine=host.info(host.engines[cmd.engine_id]))
        pred = host.engines.get(predecessor)
        serving = pred if pred is not None and pred.live else None  # stopped here, retired once replaced
        if serving is not None:
            serving.handing_over = True
            serving.transition(Ev.STOP)  # a planned replacement, not a fault
            host.save(serving)
            await host.kill_confirmed(serving)
        try:
            rec = await self._on_spare(cmd, key, pred) if cmd.spare is not None else None
            if rec is None:
                rec = host.start_engine(key, EngineRole.ACTIVE, engine_id=cmd.engine_id, spec=cmd.spec,
                                        extra_env={**orders, "HF_INCIDENT_ID": cmd.incident_id or ""}, replacing=pred,
                                        gang=gang, same_gpu=False)
        finally:
            if serving is not None:
                serving.handing_over = False
                host.retire(serving)
        return SpawnReply(engine=host.info(rec))

    async def _on_spare(self, cmd: Spawn, key: str, pred: EngineRecord | None) -> EngineRecord | None:
        """The spare `cmd.spare` as the incident's successor, ready (once per incident: a repeated spawn awaits the
        first one's); None when it cannot be (the caller starts a cold engine)."""
        ident = cmd.incident_id or cmd.engine_id or ""
        task = self._spares.get(ident)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._assign_spare(cmd, key, pred), name=f"spare:{ident}")
            self._spares[ident] = task
        return await asyncio.shield(task)  # a caller that times out must not cancel the assignment

    async def _assign_spare(self, cmd: Spawn, key: str, pred: EngineRecord | None) -> EngineRecord | None:
        host = self.host
        named = cmd.spare or ""
        sb = pick_spare(host.records(), key, named, host.gpu_health.unhealthy, tp=cmd.spec.tp)
        if sb is None:
            log.warning("spawn for %s: %s is no warm spare of %s on a healthy GPU now; starting a cold engine",
                        cmd.incident_id, named, key)
            return None
        host.starts.admit_active(key, replacing=pred, candidate=sb.engine_id)
        t0 = time.perf_counter()
        whose = cmd.backup_of or cmd.predecessor  # the engine (or group) whose backups it continues, if any
        sb.transition(Ev.ASSIGN)
        sb.role, sb.spare, sb.taking_over = EngineRole.ACTIVE, False, whose
        sb.generation = pred.generation + 1 if pred is not None else 0
        orders: dict[str, Any] = {"predecessor": cmd.backup_of or "", "transfer_token": cmd.transfer_token or ""}
        if cmd.degrade_gang is not None:  # a spare group: the broken gang's backups, as a degraded group takes them
            orders = {"predecessor": cmd.predecessor or "", "transfer_token": cmd.transfer_token or "",
                      "gang": cmd.degrade_gang, "gang_generation": cmd.gang_generation, "degraded": True}
            sb.gang = cmd.degrade_gang  # the group keeps the broken gang's id (its incidents freeze that gang)
        try:
            await host.assign(sb, {"op": "assign", "model": sb.model, "incident_id": cmd.incident_id, **orders})
            await host.wait_ready(sb.engine_id, host.settings.takeover_timeout_s)
        except (ConnectionError, OSError, RuntimeError, TimeoutError) as e:
            log.warning("spare %s failed as the successor of %s (%s); starting a cold engine", sb.engine_id,
                        whose or cmd.incident_id, e or "timed out")
            if sb.live:
                host.fault(sb, FaultKind.HUNG, detail=f"failed as a spare's successor: {e}", died_at=time.time())
            await host.kill_confirmed(sb)
            host.retire(sb)
            return None
        sb.successor_of = whose
        host.save(sb)
        log.info("spawn for %s: spare %s on GPU %d serves in %.1f ms%s", cmd.incident_id, sb.engine_id, sb.gpu,
                 (time.perf_counter() - t0) * 1000, f", from {whose}'s KV backups" if whose else "")
        host.reconcile_soon()  # the next spare, where a GPU is free for one
        return sb

    async def stop(self, cmd: StopEngine) -> StopReply:
        await self._in_term(cmd)
        host = self.host
        rec = host.get(cmd.engine_id)
        spec = host.specs.get(rec.spec_key or "")
        if spec is not None:
            # Stopping on purpose means one fewer of that kind: otherwise the reconciler would start it again.
            field = "replicas" if rec.role is EngineRole.ACTIVE else "spares" if rec.spare else "standbys"
            spec = spec.model_copy(update={field: max(0, getattr(spec, field) - 1)})
            host.specs[rec.spec_key or ""] = spec
            host.writer.put_spec(host.node, rec.spec_key or "", spec)
        code = await host.stop(cmd.engine_id)
        return StopReply(engine_id=cmd.engine_id, exit_code=code)

    async def _in_term(self, cmd: StopEngine) -> None:
        """Raise the refusal of a stop whose controller term is not the one leading now (before anything is done)."""
        if not cmd.term:
            return
        why = refusal(cmd.term, await self.term_now())
        if why is None:
            return
        if isinstance(why, StaleTerm):
            self.refused += 1
        log.warning("stop of %s refused: %s: %s", cmd.engine_id, why.code, why.message)
        raise why

    async def list_engines(self, cmd: ListEngines) -> ListEnginesReply:
        host = self.host
        return ListEnginesReply(engines=[host.info(r) for r in host.records()], backoff=host.backoff_report())
