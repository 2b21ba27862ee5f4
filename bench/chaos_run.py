"""The chaos run's moving parts: the load, the sampled invariants, the supervisor and the injectors of each
fault kind (bench/chaos.py drives them and checks the end state; chaos_faults.py holds the harder faults)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from bench import chaos_faults as cf
from bench.chaos_checks import IncidentTracker, excess
from devstack.scenario import MODEL, PROMPTS, Scenario
from libs.common import procs
from libs.common.events import EngineInfo, Envelope, LeaseState, MarkGpu, MarkGpuReply

console = Console(stderr=True)

# How long a fault waits for its target (a ready engine, a listening agent) before it is counted as skipped:
# on a loaded 2-core machine an agent restarted by the previous fault takes tens of seconds to listen again.
WAIT_FOR_TARGET_S = 60.0

FAULTS = ("engine_sigkill", "engine_sigstop", "engine_cuda_error", "engine_sigkill_allocating", "gpu_xid",
          "gpu_manager_sigkill", "gpu_manager_fd_pressure", "agent_sigkill", "dc_manager_sigkill",
          "router_sigkill", "controller_leader_sigkill", "nats_restart", "etcd_restart", "etcd_stall",
          "admin_api_load")
SERVICE_KILLS = ("gpu_manager_sigkill", "agent_sigkill", "dc_manager_sigkill")  # the router: router_sigkill()
TRANSPORT_ERRORS = ("ConnectError", "ReadError", "RemoteProtocolError", "WriteError", "ConnectTimeout")


def lease_writers(state_dir: Path) -> dict[str, set[int]]:
    """Which live, running engine processes of this stack map each lease writable (from /proc/<pid>/maps)."""
    holders: dict[str, set[int]] = {}
    for pid in cf.engine_pids(state_dir):
        if cf.proc_state(pid) in "TtZX":
            continue  # stopped or dead: cannot write
        for lease in cf.writable_leases(pid):
            holders.setdefault(lease, set()).add(pid)
    return holders


def serving(pid: int | None) -> bool:
    """The process exists and runs (a stopped or zombie one answers nothing)."""
    return bool(pid) and cf.proc_state(int(pid)) not in "TtZX"


@dataclass
class Tally:
    ok: int = 0
    errors: int = 0  # explicit errors (503 after the hold timeout...): answered, not lost
    router_down: int = 0  # refused or cut while the router itself was down (explicit to the client)
    lost: int = 0
    wrong: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    two_writer_samples: list[dict[str, Any]] = field(default_factory=list)
    replica_samples: list[dict[str, Any]] = field(default_factory=list)
    restarts: Counter[str] = field(default_factory=Counter)  # the stack supervisor's (not chaos's kills)
    allocating: Counter[str] = field(default_factory=Counter)
    pressure: dict[str, Counter[str]] = field(default_factory=dict)
    manager_unserved: int = 0
    api_statuses: Counter[str] = field(default_factory=Counter)
    failover_ms: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Chaos:
    def __init__(self, sc: Scenario, rng: random.Random, tally: Tally) -> None:
        self.sc = sc
        self.rng = rng
        self.tally = tally
        self.stop = asyncio.Event()
        self.busy: set[str] = set()  # services chaos itself is killing and restarting (the supervisor waits)
        self.router_outages: list[tuple[float, float]] = []  # (killed, serving again) wall times
        self.incidents = IncidentTracker()

    @property
    def stack(self) -> Any:
        assert self.sc.stack is not None
        return self.sc.stack

    @property
    def state_dir(self) -> Path:
        return Path(self.stack.base_dir) / "state"

    @property
    def nvml_socket(self) -> str:
        return str(self.state_dir / "chaos-nvml.sock")

    # ------------------------------------------------------------ load

    async def load(self, client: httpx.AsyncClient, baseline: dict[str, Any], worker: int) -> None:
        i = worker
        while not self.stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            t0 = time.time()
            r = await self.sc.generate(client, prompt)
            if r.done and not r.error:
                if r.tokens == baseline[prompt].tokens:
                    self.tally.ok += 1
                else:
                    self.tally.wrong += 1
                    want = baseline[prompt].tokens
                    at = next((j for j, (a, b) in enumerate(zip(r.tokens, want, strict=False)) if a != b),
                              min(len(r.tokens), len(want)))
                    self.tally.notes.append(f"wrong: {prompt!r}: {len(r.tokens)} tokens for {len(want)}, first "
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
        while not self.stop.is_set():
            holders = await asyncio.to_thread(lease_writers, self.state_dir)
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
                routed = await self.sc.store.get_prefix(f"endpoints/{MODEL}/")
            except Exception:  # noqa: BLE001 - etcd restarting or stalled: no sample
                continue
            live = {e.engine_id for e in engines if serving(e.pid)}
            active = [e.engine_id for e in engines if e.role == "active" and e.state == "ready"
                      and e.model == MODEL and e.engine_id in live]
            endpoints = [k.rsplit("/", 1)[-1] for k in routed]
            bad = excess(time.time(), MODEL, replicas, active, [e for e in endpoints if e in live])
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
        self.incidents.heard(str(getattr(env.data, "incident_id", env.incident_id)), outcome, env.id, time.monotonic())

    # ------------------------------------------------------------ the supervisor

    async def supervise(self) -> None:
        """The stack's own supervisor (Stack.supervise_once, as `holdfast up` runs it) restarts a service that
        exited on its own; it passes while chaos is killing and restarting one itself (no double restart)."""
        while not self.stop.is_set():
            await asyncio.sleep(0.5)
            if not self.busy:
                await asyncio.to_thread(self.stack.supervise_once, self._supervisor_says)

    def _supervisor_says(self, line: str) -> None:
        self.tally.notes.append(f"supervisor: {line}")
        console.print(f"[red]supervisor: {line}[/red]")
        if " restarted (pid " in line:
            self.tally.restarts[line.split()[0]] += 1

    async def restart(self, name: str, *, kill: bool = True) -> None:
        self.busy.add(name)
        try:
            if kill:
                self.stack.kill(name)
                await asyncio.sleep(0.2)
            await asyncio.to_thread(self.stack.restart, name)
        finally:
            self.busy.discard(name)

    # ------------------------------------------------------------ faults

    async def active_engine(self, within_s: float = 0.0) -> EngineInfo | None:
        """The ready active engine; waited for up to `within_s` (a fault due while the previous one's effects
        settle, e.g. a store reconnecting after an etcd stall, lands once there is one, rather than being skipped)."""
        deadline = time.monotonic() + within_s
        while True:
            engine = await self._engine("active")
            if engine is not None or time.monotonic() >= deadline:
                return engine
            await asyncio.sleep(0.2)

    async def _engine(self, role: str) -> EngineInfo | None:
        try:
            engines = await self.sc.engines()
        except Exception:  # noqa: BLE001 - etcd may be restarting
            return None
        ok = ("ready",) if role == "active" else ("standby", "ready")
        found = [e for e in engines if e.role == role and e.state in ok and e.pid and serving(e.pid)]
        return found[0] if found else None

    async def inject(self, fault: str) -> None:
        self.tally.faults[fault] += 1
        if fault.startswith("engine_") and fault != "engine_sigkill_allocating":
            await self._signal_engine(fault)
        elif fault in SERVICE_KILLS:
            await self.restart(fault.removesuffix("_sigkill"))
        elif fault == "controller_leader_sigkill":
            await self.restart(await self._leader_name())
        elif fault in ("nats_restart", "etcd_restart"):
            await self.restart(fault.removesuffix("_restart"), kill=False)
        else:
            await getattr(self, fault)()

    async def _signal_engine(self, fault: str) -> None:
        engine = await self.active_engine(within_s=WAIT_FOR_TARGET_S)
        if engine is None or engine.pid is None:
            self._skip(fault, "no ready engine")
            return
        sig = {"engine_sigkill": signal.SIGKILL, "engine_sigstop": signal.SIGSTOP,
               "engine_cuda_error": signal.SIGUSR1}[fault]
        t_kill = time.time()
        os.kill(engine.pid, sig)  # SIGUSR1: the reference engine reports a fatal CUDA error and exits
        if fault == "engine_sigkill":
            await self._time_failover(fault, engine.engine_id, t_kill)

    def _skip(self, fault: str, why: str) -> None:
        self.tally.skipped[fault] += 1
        self.tally.notes.append(f"{fault}: {why}, skipped")

    async def _leader_name(self) -> str:
        leader = None
        try:
            raw = await self.sc.store.get("leader/controller") if self.sc.store else None
            leader = raw.decode() if raw else None
        except Exception:  # noqa: BLE001
            pass
        return next((n for n, c in self.stack.children.items() if n.startswith("controller") and leader
                     and str(c.pid) in leader), None) or self.rng.choice(["controller", "controller-2"])

    async def _time_failover(self, fault: str, engine_id: str, t_kill: float, timeout: float = 30.0) -> None:
        """Death -> incident.resolved of this engine's incident (ms), kept per fault kind."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, env in self.sc.events:
                if env.type == "incident.resolved" and getattr(env.data, "engine_id", None) == engine_id \
                        and at >= t_kill:
                    self.tally.failover_ms.setdefault(fault, []).append(round((at - t_kill) * 1000, 1))
                    return
            await asyncio.sleep(0.01)

    async def router_sigkill(self) -> None:
        down = time.time()
        self.router_outages.append((down, 0.0))
        await self.restart("router")
        await asyncio.to_thread(procs.wait_port, self.stack.config.router_port, self.stack.children["router"])
        self.router_outages[-1] = (down, time.time())

    async def etcd_stall(self) -> None:
        etcd = self.stack.children["etcd"]
        stalled = self.rng.uniform(3.0, 15.0)
        self.busy.add("etcd")
        try:
            os.kill(etcd.pid, signal.SIGSTOP)
            await asyncio.sleep(stalled)
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
            self.busy.discard("etcd")

    async def gpu_xid(self) -> None:
        xid = self.rng.choice((48, 63, 74, 79, 94, 95))
        deadline = time.monotonic() + WAIT_FOR_TARGET_S  # an agent just restarted listens once its watcher runs
        while True:
            try:
                cf.send_xid(self.nvml_socket, 0, xid)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    self._skip("gpu_xid", f"no agent listening ({e})")
                    return
                await asyncio.sleep(0.2)
        await self._gpu_reset(0)

    async def _gpu_reset(self, gpu: int) -> None:
        """What an operator does after an XID: the GPU reset, marked healthy again. The agent keeps a GPU that
        reported an XID unhealthy (nothing is placed on it) until then; on a one-GPU node the model would stay down
        for the rest of the run. Once the fault has taken the engines down (the agent marked it)."""
        await asyncio.sleep(1.0)
        assert self.sc.bus is not None
        try:
            await self.sc.bus.request(self.stack.config.node, MarkGpu(gpu=gpu, healthy=True, detail="chaos: GPU reset"),
                                      MarkGpuReply, timeout=15)
        except Exception as e:  # noqa: BLE001 - the agent may be restarting: noted, and settle() says the rest
            self.tally.notes.append(f"gpu reset not acknowledged: {type(e).__name__}: {e}")

    async def engine_sigkill_allocating(self) -> None:
        """Make an engine start (a standby killed, or every engine of the GPU lost to an XID, in turn) and
        SIGKILL the first new one while it holds an uncommitted lease."""
        loop = asyncio.get_running_loop()

        def uncommitted(lease_id: str) -> str | None:
            reply = asyncio.run_coroutine_threadsafe(self.sc.leases(), loop).result(10)
            for lease in reply.leases:
                if lease.id == lease_id and lease.state is LeaseState.ACTIVE and lease.layout_hash is None:
                    return str(lease.tag)
            return None

        before = await asyncio.to_thread(cf.engine_pids, self.state_dir)
        catch = asyncio.create_task(asyncio.to_thread(cf.catch_allocating, self.state_dir, before, uncommitted))
        await asyncio.sleep(0.05)
        standby = await self._engine("standby")
        if self.tally.faults["engine_sigkill_allocating"] % 2 == 1 and standby is not None and standby.pid:
            os.kill(standby.pid, signal.SIGKILL)
            trigger = "standby"
        else:
            await self.gpu_xid()
            trigger = "xid"
        out = await catch
        label = f"{out['result']}:{out.get('tag', '-')}"
        self.tally.allocating[label] += 1
        self.tally.allocating[f"trigger:{trigger}"] += 1

    async def gpu_manager_fd_pressure(self) -> None:
        """A hostile client holds many connections and asks for absurd leases; an engine is SIGKILLed under it
        (its successor must get its memory through the same manager)."""
        async def kill_engine() -> None:
            await self._signal_engine("engine_sigkill")

        report = await cf.pressure(str(self.state_dir / "gpu_manager.sock"), kill_engine)
        for key, value in report.items():
            self.tally.pressure.setdefault(key, Counter())[str(value)] += 1
        if report.get("probe_after") != "ok":
            self.tally.manager_unserved += 1
            self.tally.notes.append(f"gpu_manager unserved after fd pressure: {report}")

    async def admin_api_load(self) -> None:
        """Large bodies on the admin API (three loops, two without a token) while an engine's incident runs."""
        stop = asyncio.Event()
        load = asyncio.create_task(cf.api_load(self.stack.api_url, self.stack.config.api_token,
                                               self.stack.config.node, stop))
        await asyncio.sleep(1.0)
        engine = await self.active_engine(within_s=WAIT_FOR_TARGET_S)
        if engine is None or engine.pid is None:
            self._skip("admin_api_load", "no ready engine to kill under the load")
        else:
            t_kill = time.time()
            os.kill(engine.pid, signal.SIGKILL)
            await self._time_failover("admin_api_load", engine.engine_id, t_kill)
        stop.set()
        self.tally.api_statuses.update(await load)

    async def settle(self, timeout: float = 90.0) -> bool:
        """Until an engine serves again with a standby beside it."""
        try:
            await self.sc.wait_serving(timeout=timeout)
            return True
        except Exception as e:  # noqa: BLE001 - reported as a note; the invariants say whether it mattered
            self.tally.notes.append(f"not settled: {e}")
            return False


