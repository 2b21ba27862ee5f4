"""The simulated cluster: nodes that answer the real commands (freeze, takeover, spawn, reclaim, stop) on NATS
with the real reply models and write their state (nodes, gpus, engines, leases) to etcd as the agent and the
gpu_manager would; only the engines themselves are absent. `holdfast bench controlplane` drives it against
real controller and dc_manager processes, and the controller and dc_manager tests use it for the node side.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any

from libs.common.bus import Bus
from libs.common.errors import NotFound
from libs.common.events import (
    EngineInfo,
    EngineReady,
    EngineRole,
    Envelope,
    FaultDetected,
    FaultKind,
    Freeze,
    FreezeReply,
    LeaseInfo,
    LeaseState,
    MemoryFrozen,
    Reclaim,
    ReclaimReply,
    Spawn,
    SpawnReply,
    StopEngine,
    StopReply,
    Tag,
    Takeover,
    TakeoverReply,
    engine_record_key,
)
from libs.common.store import Store, encode_value

GIB = 1 << 30


class SimulatedCluster:
    """Node-side responders for every node at once (wildcard subjects) plus their etcd records."""

    def __init__(self, bus: Bus, store: Store, nodes: int, gpus_per_node: int, *, lease_bytes: int = 40 * GIB,
                 gpu_bytes: int = 141 * GIB, record: bool = True, emit_events: bool = True) -> None:
        self.bus, self.store = bus, store
        self.node_names = [f"n{i:04d}" for i in range(nodes)]
        self.gpus_per_node = gpus_per_node
        self.lease_bytes, self.gpu_bytes = lease_bytes, gpu_bytes
        self.record, self.emit_events = record, emit_events
        self.engines: dict[str, EngineInfo] = {}
        self.leases: dict[str, LeaseInfo] = {}
        self.owned: dict[str, set[str]] = {}  # owner -> its lease ids (a freeze must not scan 8,000 leases)
        self.frozen: dict[str, FreezeReply] = {}
        self.takeovers: dict[str, asyncio.Future[TakeoverReply]] = {}
        self.freeze_calls = 0
        self.takeover_calls = 0
        self.spawn_calls = 0
        self.takeover_gate: asyncio.Event | None = None  # tests: hold takeovers until set
        self.reply_gate: asyncio.Event | None = None  # tests: hold takeovers' replies (the takeover done) until set
        self.takeover_started = asyncio.Event()
        self.spawn_ready_s = 0.05  # a cold engine's load time (real engines: seconds to minutes)
        self.ready_gate: asyncio.Event | None = None  # tests: hold cold engines "loading" until set
        self.stopped: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @staticmethod
    def engine_id(node: str, gpu: int) -> str:
        return f"{node}-g{gpu}-e0"

    async def populate(self) -> None:
        kv: list[tuple[str, Any]] = []
        for node in self.node_names:
            kv.append((f"nodes/{node}", {"node": node, "datacenter": "dc-1", "agent_pid": os.getpid(),
                                         "started_at": time.time(), "gpus": list(range(self.gpus_per_node))}))
            for gpu in range(self.gpus_per_node):
                eid = self.engine_id(node, gpu)
                info = EngineInfo(engine_id=eid, node=node, model="m", engine_class="sim", role=EngineRole.ACTIVE,
                                  gpu=gpu, endpoint=f"http://127.0.0.1:9/{eid}", state="ready")
                lease = LeaseInfo(id=f"L-{eid}", node=node, gpu=gpu, size=self.lease_bytes, chunk_size=GIB,
                                  tag=Tag.WEIGHTS, owner=eid, engine_class="sim", epoch=1, state=LeaseState.ACTIVE,
                                  created_at=time.time(), last_seen=time.time())
                self.engines[eid], self.leases[lease.id] = info, lease
                self.owned.setdefault(eid, set()).add(lease.id)
                kv += [(f"gpus/{node}/{gpu}", {"healthy": True, "total_bytes": self.gpu_bytes}),
                       (engine_record_key(node, eid), info), (f"allocations/{node}/{lease.id}", lease),
                       (f"endpoints/m/{eid}", info.endpoint)]
        await self.put_many(kv)

    async def put_many(self, kv: list[tuple[str, Any]], batch: int = 100) -> None:
        """Batched writes in transactions (etcd allows 128 operations in one)."""
        t = self.store.client.transactions

        async def write(chunk: list[tuple[str, Any]]) -> None:
            ops = [t.put(self.store.full(k), encode_value(v)) for k, v in chunk]
            await self.store.client.transaction(compare=[], success=ops, failure=[])

        chunks = [kv[i:i + batch] for i in range(0, len(kv), batch)]
        for i in range(0, len(chunks), 16):
            await asyncio.gather(*(write(c) for c in chunks[i:i + 16]))

    async def serve(self) -> None:
        # Freeze and takeover publish nothing when events are off (the benchmark): no trace context to carry on.
        quiet = not self.emit_events and not self.record
        # ... and each answers at once (no gate, no etcd write): answered in the subscription's task, no task each.
        quiet = quiet and self.takeover_gate is None and self.reply_gate is None
        await self.bus.serve("*", Freeze, self.freeze, attach_trace=not quiet, inline=quiet)
        await self.bus.serve("*", Takeover, self.takeover, attach_trace=not quiet, inline=quiet)
        for node in self.node_names:  # per node: a cold engine runs on the node it was sent to (placement)
            await self.bus.serve(node, Spawn, functools.partial(self.spawn, node=node))
        await self.bus.serve("*", Reclaim, self.reclaim)
        await self.bus.serve("*", StopEngine, self.stop)

    async def fail(self, engine_id: str, kind: FaultKind = FaultKind.KILLED) -> Envelope:
        env = self.fault(engine_id, kind)
        await self.bus.publish(env)
        return env

    def fault(self, engine_id: str, kind: FaultKind = FaultKind.KILLED) -> Envelope:
        """The FaultDetected an agent would publish for this engine's death now (not yet published)."""
        return self.bus.envelope(self.fault_event(engine_id, kind))

    def fault_event(self, engine_id: str, kind: FaultKind = FaultKind.KILLED) -> FaultDetected:
        e = self.engines[engine_id]
        return FaultDetected(engine_id=engine_id, model=e.model, engine_class=e.engine_class, generation=e.generation,
                             kind=kind, gpu=e.gpu, node=e.node, signal=9 if kind is FaultKind.KILLED else None,
                             died_at=time.time())

    # ------------------------------------------------------------ gpu_manager side

    async def freeze(self, cmd: Freeze) -> FreezeReply:
        self.freeze_calls += 1
        if cmd.owner in self.frozen:
            return self.frozen[cmd.owner]  # idempotent: the same token for a repeated freeze
        mine = [self.leases[i] for i in sorted(self.owned.get(cmd.owner, ()))
                if self.leases[i].state is not LeaseState.RECLAIMED]
        if not mine:
            raise NotFound(f"no leases owned by {cmd.owner}")
        epoch = max(lease.epoch for lease in mine) + 1
        reply = FreezeReply(lease_ids=[lease.id for lease in mine], epoch=epoch, transfer_token=f"tok-{cmd.owner}-{epoch}")
        self.frozen[cmd.owner] = reply
        for lease in mine:
            self.leases[lease.id] = lease.model_copy(update={"state": LeaseState.FROZEN, "epoch": epoch})
        if self.emit_events:
            await self.bus.emit(MemoryFrozen(owner=cmd.owner, lease_ids=reply.lease_ids, epoch=epoch,
                                             incident_id=cmd.incident_id), node=mine[0].node)  # the owner's node
        return reply

    async def reclaim(self, cmd: Reclaim) -> ReclaimReply:
        lease = self.leases.get(cmd.lease_id)
        if lease is None:
            raise NotFound(f"no lease {cmd.lease_id}")
        lease = self.leases[cmd.lease_id] = lease.model_copy(update={"state": LeaseState.RECLAIMED})
        if self.record:
            await self.store.put(f"allocations/{lease.node}/{lease.id}", lease)
        return ReclaimReply(lease=lease)

    # ------------------------------------------------------------ agent side

    async def takeover(self, cmd: Takeover) -> TakeoverReply:
        self.takeover_calls += 1
        self.takeover_started.set()
        fut = self.takeovers.get(cmd.incident_id)
        if fut is None:  # idempotent by incident: a retried takeover gets the first one's successor
            fut = self.takeovers[cmd.incident_id] = asyncio.get_running_loop().create_future()
            if self.takeover_gate is None and not self.record:
                await self._do_takeover(cmd, fut)  # nothing to wait for: no task of its own (the benchmark)
            else:
                asyncio.create_task(self._do_takeover(cmd, fut))
        reply = await asyncio.shield(fut)
        if self.reply_gate is not None:
            await self.reply_gate.wait()
        return reply

    async def _do_takeover(self, cmd: Takeover, fut: asyncio.Future[TakeoverReply]) -> None:
        if self.takeover_gate is not None:
            await self.takeover_gate.wait()
        old = self.engines[cmd.engine_id]
        frozen = self.frozen.get(cmd.engine_id)
        if frozen is None or frozen.transfer_token != cmd.transfer_token:
            fut.set_exception(NotFound(f"no frozen memory of {cmd.engine_id} for this token"))
            return
        succ = old.model_copy(update={"engine_id": f"{old.engine_id}-s{old.generation + 1}",
                                      "generation": old.generation + 1, "version": cmd.version or old.version,
                                      "endpoint": f"http://127.0.0.1:9/{old.engine_id}-s{old.generation + 1}"})
        self.engines[succ.engine_id] = succ
        for lease_id in frozen.lease_ids:
            self.owned.get(self.leases[lease_id].owner, set()).discard(lease_id)
            self.owned.setdefault(succ.engine_id, set()).add(lease_id)
            self.leases[lease_id] = self.leases[lease_id].model_copy(update={"owner": succ.engine_id,
                                                                             "state": LeaseState.ACTIVE})
        if self.record:
            await self.store.put(engine_record_key(succ.node, succ.engine_id), succ)
        fut.set_result(TakeoverReply(engine=succ, used_standby=True, timings_ms={"attach": 0.0}))

    async def spawn(self, cmd: Spawn, node: str | None = None) -> SpawnReply:
        """Start a cold engine: answered at once as `starting`; ready (etcd + `engine.ready`) after
        `spawn_ready_s`, or when `ready_gate` is set, as a real engine loading its weights would be."""
        self.spawn_calls += 1
        eid = cmd.engine_id or f"spawned-{self.spawn_calls}"
        if eid in self.engines:
            return SpawnReply(engine=self.engines[eid])  # idempotent: a retried spawn gets the same engine
        info = EngineInfo(engine_id=eid, node=node or self.node_names[0], model=cmd.spec.model, engine_class=cmd.spec.engine_class,
                          role=EngineRole.ACTIVE, gpu=cmd.spec.gpus[0], endpoint=f"http://127.0.0.1:9/{eid}",
                          state="starting", version=cmd.spec.version)
        self.engines[eid] = info
        if self.record:
            await self.store.put(engine_record_key(info.node, eid), info)
        task = asyncio.create_task(self._become_ready(eid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return SpawnReply(engine=info)

    async def _become_ready(self, eid: str) -> None:
        if self.ready_gate is not None:
            await self.ready_gate.wait()
        else:
            await asyncio.sleep(self.spawn_ready_s)
        if eid in self.stopped:
            return
        info = self.engines[eid] = self.engines[eid].model_copy(update={"state": "ready"})
        if self.record:
            await self.store.put(engine_record_key(info.node, eid), info)
        await self.bus.emit(EngineReady(engine=info))

    async def stop(self, cmd: StopEngine) -> StopReply:
        if cmd.engine_id not in self.engines:
            raise NotFound(f"no engine {cmd.engine_id}")
        self.stopped.add(cmd.engine_id)
        self.engines[cmd.engine_id] = self.engines[cmd.engine_id].model_copy(update={"state": "stopped"})
        if self.record:
            info = self.engines[cmd.engine_id]
            await self.store.put(engine_record_key(info.node, cmd.engine_id), info)
        return StopReply(engine_id=cmd.engine_id, exit_code=0)
