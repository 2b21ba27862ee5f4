"""The chaos run's moving parts: the load, the sampled invariants, the supervisor, and which faults run at once
and when each has settled (bench/chaos.py drives them and checks the end state; chaos_inject.py injects each
kind, chaos_lanes.py says which may overlap)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from bench import chaos_faults as cf
from bench.chaos_checks import IncidentTracker, excess
from bench.chaos_inject import Injectors, Tally, console, serving
from bench.chaos_lanes import SERVICE_OF, Claims, resources
from devstack.scenario import PROMPTS, Scenario
from libs.common import procs
from libs.common.events import Envelope

FAULTS = ("engine_sigkill", "engine_sigstop", "engine_cuda_error", "engine_sigkill_allocating", "gpu_xid",
          "gpu_manager_sigkill", "gpu_manager_fd_pressure", "agent_sigkill", "dc_manager_sigkill",
          "router_sigkill", "controller_leader_sigkill", "nats_restart", "etcd_restart", "etcd_stall",
          "admin_api_load")
SETTLE_S = 90.0  # a model serving again with its standbys, a service healthy again, after its fault
TRANSPORT_ERRORS = ("ConnectError", "ReadError", "RemoteProtocolError", "WriteError", "ConnectTimeout")
__all__ = ["FAULTS", "Chaos", "Tally"]


def _can_write(pid: int) -> bool:
    return not (cf.proc_state(pid) in "TtZX" or procs.stopped(pid, None))  # stopped, dead, or every thread exiting


def lease_writers(scan: cf.EngineScan) -> dict[str, set[int]]:
    """Which live, running engine processes of this stack map each lease writable (from /proc/<pid>/maps), at
    the scan's end: a process is counted only if it can still write once every process's maps were read. (Read
    one after another, a predecessor read alive, then killed, and its successor mapping the lease a millisecond
    later, read next, looked like two writers at once: an isolated takeover maps that soon after the kill.)"""
    holders: dict[str, set[int]] = {}
    for pid in scan.scan():
        if not _can_write(pid):
            continue  # a fenced takeover's predecessor among them
        for lease in cf.writable_leases(pid):
            holders.setdefault(lease, set()).add(pid)
    still = {pid for pids in holders.values() for pid in pids if _can_write(pid)}
    return {lease: pids & still for lease, pids in holders.items()}


class Chaos(Injectors):
    def __init__(self, sc: Scenario, rng: random.Random, tally: Tally) -> None:
        super().__init__(sc, rng, tally)
        self.stop = asyncio.Event()
        self.incidents = IncidentTracker()
        self.models = list(sc.models)
        self.claims = Claims()
        self._claims_changed = asyncio.Condition()

    # ------------------------------------------------------------ load

    async def load(self, client: httpx.AsyncClient, baselines: dict[str, dict[str, Any]], worker: int) -> None:
        """One client stream, to one model (worker i: model i mod the number of models)."""
        model = self.models[worker % len(self.models)]
        baseline = baselines[model]
        i = worker
        while not self.stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            t0 = time.time()
            r = await self.sc.generate(client, prompt, model=model)
            if r.done and not r.error:
                if r.tokens == baseline[prompt].tokens:
                    self.tally.ok += 1
                else:
                    self.tally.wrong += 1
                    want = baseline[prompt].tokens
                    at = next((j for j, (a, b) in enumerate(zip(r.tokens, want, strict=False)) if a != b),
                              min(len(r.tokens), len(want)))
                    self.tally.notes.append(f"wrong: {model} {prompt!r}: {len(r.tokens)} tokens for {len(want)}, first "
                                            f"difference at {at}, at {time.time():.3f} (sent {t0:.3f})")
            elif r.error and (r.error.startswith("HTTP 503") or '"code"' in r.error):
                self.tally.errors += 1
            elif r.error and r.error.split(":")[0] in TRANSPORT_ERRORS and self._router_was_down(t0, time.time()):
                self.tally.router_down += 1
                await asyncio.sleep(0.05)
            else:
                self.tally.lost += 1
                self.tally.notes.append(f"lost: {r.error}")

    def _router_was_down(self, t0: float, t1: float) -> bool:
        now = time.time()
        return any(t0 <= (up or now) + 0.5 and t1 >= down for down, up in self.router_outages)

    # ------------------------------------------------------------ sampled invariants

    async def watch_mappings(self) -> None:
        scan = cf.EngineScan(self.state_dir)
        while not self.stop.is_set():
            holders = await asyncio.to_thread(lease_writers, scan)
            for lease, pids in holders.items():
                if len(pids) > 1:
                    self.tally.two_writer_samples.append({"lease": lease, "pids": sorted(pids), "at": time.time()})
            await asyncio.sleep(0.05)

    async def watch_replicas(self, replicas: int = 1) -> None:
        assert self.sc.store is not None
        while not self.stop.is_set():
            await asyncio.sleep(0.25)
            try:
                engines = await self.sc.engines()
                routed = await self.sc.store.get_prefix("endpoints/")
            except Exception:  # noqa: BLE001 - etcd restarting or stalled: no sample
                continue
            live = {e.engine_id for e in engines if serving(e.pid)}
            for model in self.models:
                active = [e.engine_id for e in engines if e.role == "active" and e.state == "ready"
                          and e.model == model and e.engine_id in live]
                endpoints = [k.rsplit("/", 1)[-1] for k in routed if k.startswith(f"endpoints/{model}/")]
                bad = excess(time.time(), model, replicas, active, [e for e in endpoints if e in live])
                if bad is not None:
                    self.tally.replica_samples.append(bad.__dict__)

    async def watch_incidents(self) -> None:
        assert self.sc.store is not None
        while not self.stop.is_set():
            await self.snapshot_incidents()
            await asyncio.sleep(2.0)

    async def snapshot_incidents(self) -> None:
        assert self.sc.store is not None
        taken_at = time.monotonic()
        try:
            raw = await self.sc.store.get_prefix("incidents/")
        except Exception:  # noqa: BLE001 - etcd restarting or stalled
            return
        self.incidents.snapshot([json.loads(v) for v in raw.values()], taken_at)

    async def on_terminal(self, env: Envelope) -> None:
        outcome = "resolved" if env.type == "incident.resolved" else "failed"
        engine_id = getattr(env.data, "engine_id", None)
        if outcome == "resolved" and engine_id:
            self.resolved_at[str(engine_id)].append(env.time)
        self.incidents.heard(str(getattr(env.data, "incident_id", env.incident_id)), outcome, env.id, time.monotonic())

    # ------------------------------------------------------------ the supervisor

    async def supervise(self) -> None:
        """The stack's own supervisor (Stack.supervise_once, as `holdfast up` runs it) restarts a service that
        exited on its own; it passes while chaos is killing and restarting one itself (no double restart)."""
        while not self.stop.is_set():
            await asyncio.sleep(0.5)
            await asyncio.to_thread(self.stack.supervise_once, self._supervisor_says, skip=set(self.busy))

    def _supervisor_says(self, line: str) -> None:
        self.tally.notes.append(f"supervisor: {line}")
        console.print(f"[red]supervisor: {line}[/red]")
        if " restarted (pid " in line:
            self.tally.restarts[line.split()[0]] += 1

    # ------------------------------------------------------------ which faults run at once (chaos_lanes.py)

    @contextlib.asynccontextmanager
    async def holding(self, want: frozenset[str]) -> AsyncIterator[None]:
        """Hold `want` (first come, first served among conflicting requests) for the body."""
        async with self._claims_changed:
            ticket = self.claims.request(want)
            while True:
                if self.claims.grant():
                    self._claims_changed.notify_all()
                if ticket in self.claims.held:
                    break
                await self._claims_changed.wait()
        try:
            yield
        finally:
            async with self._claims_changed:
                self.claims.release(ticket)
                self.claims.grant()
                self._claims_changed.notify_all()

    def _taken(self) -> set[str]:
        return set().union(*self.claims.held.values(), *(w for _, w in self.claims.waiting))

    def pick_model(self) -> str:
        """A model no fault holds or waits for, when there is one (else any): engine faults spread over models."""
        taken = self._taken()
        free = [m for m in self.models if f"model:{m}" not in taken]
        return self.rng.choice(free or self.models)

    def _via_xid(self, fault: str) -> bool:
        return fault == "engine_sigkill_allocating" and self.tally.faults[fault] % 2 == 0  # xid, standby in turn

    def can_start(self, fault: str) -> bool:
        """Nothing `fault` needs is held or waited for now (on a free model, for an engine fault)."""
        want = resources(fault, self.pick_model(), self.models, via_xid=self._via_xid(fault))
        return not (want & self._taken())

    async def run_fault(self, fault: str) -> None:
        """One fault: its resources taken, injected, and held until what it hit serves again."""
        model = self.pick_model()
        via_xid = self._via_xid(fault)
        async with self.holding(resources(fault, model, self.models, via_xid=via_xid)):
            console.print(f"[yellow]{sum(self.tally.faults.values()) + 1}: inject {fault} ({model})[/yellow]")
            t0 = time.monotonic()
            hit = await self.inject(fault, model, via_xid=via_xid)
            await self.settle_after(fault, model, hit)
            self.tally.busy_s.setdefault(fault, []).append(round(time.monotonic() - t0, 2))

    async def settle_after(self, fault: str, model: str, hit: str | None) -> None:
        """Until what `fault` hit serves again: the engine it hit replaced and its model serving with its standbys
        (every model after an XID), or the service it restarted healthy. Waits on those conditions, not a clock;
        one not met within SETTLE_S is a note (the invariants say whether it mattered)."""
        try:
            async with asyncio.timeout(SETTLE_S):
                if hit is not None:
                    await self._replaced(hit)
                if fault == "gpu_xid":
                    for m in self.models:
                        await self._serving(m)
                elif fault.startswith("engine_") or fault in ("gpu_manager_fd_pressure", "admin_api_load"):
                    await self._serving(model)
                if fault in SERVICE_OF and fault != "etcd_stall":
                    await self._healthy(SERVICE_OF[fault])
        except Exception as e:  # noqa: BLE001 - reported as a note
            self.tally.notes.append(f"not settled after {fault} ({model}): {type(e).__name__}: {e}")

    async def _serving(self, model: str) -> None:
        """Scenario.wait_serving, asked again when etcd is restarting or stalled (another fault in flight)."""
        while True:
            try:
                await self.sc.wait_serving(model=model, timeout=SETTLE_S)
                return
            except TimeoutError:
                raise
            except Exception:  # noqa: BLE001 - the store unreachable for now
                await asyncio.sleep(0.2)

    async def _replaced(self, engine_id: str) -> None:
        """Until no record says the engine `engine_id` is the ready active one (a SIGSTOPped engine's record says
        so until its hang is detected)."""
        while True:
            with contextlib.suppress(Exception):  # etcd may be restarting: asked again
                if not any(e.engine_id == engine_id and e.role == "active" and e.state == "ready"
                           for e in await self.sc.engines()):
                    return
            await asyncio.sleep(0.1)

    async def _healthy(self, service: str) -> None:
        if service in ("nats", "etcd", "router"):
            port = {"nats": self.stack.config.nats_port, "etcd": self.stack.config.etcd_port,
                    "router": self.stack.config.router_port}[service]
            await self.listening(port)
            return
        if service == "controller":
            await self._led()
            return
        while True:
            try:
                await self.stack.wait_healthy([service], timeout=SETTLE_S)
                return
            except RuntimeError:  # it exited while starting: the supervisor starts it again
                await asyncio.sleep(0.5)

    async def _led(self) -> None:
        """Until a live controller holds the leader key (its candidate name carries its pid)."""
        while True:
            with contextlib.suppress(Exception):  # etcd may be restarting or stalled: asked again
                raw = await self.sc.store.get("leader/controller") if self.sc.store else None
                pids = [str(c.pid) for n, c in self.stack.children.items() if n.startswith("controller") and c.alive()]
                if raw and any(pid in raw.decode() for pid in pids):
                    return
            await asyncio.sleep(0.1)
