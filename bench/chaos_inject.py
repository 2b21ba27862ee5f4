"""The chaos run's fault injectors, one method per kind (bench/chaos_run.py schedules them and watches the
invariants; chaos_faults.py holds the mechanics of the harder ones), and the run's counts (`Tally`)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from bench import chaos_faults as cf
from devstack.scenario import Scenario
from libs.common import procs
from libs.common.events import EngineInfo, LeaseState, MarkGpu, MarkGpuReply

console = Console(stderr=True)

# How long a fault waits for its target (a ready engine, a listening agent) before it is counted as skipped:
# on a loaded 2-core machine an agent restarted by the previous fault takes tens of seconds to listen again, and
# after an XID the agent starts a model's new active engine only once the failed one's takeover wait (60 s) is
# over, even when its incident has already failed (nowhere to put it while the GPU was unhealthy).
WAIT_FOR_TARGET_S = 150.0
RESET_TRIES_S = 120.0  # how long a GPU reset is asked again while the agent does not answer
SERVICE_KILLS = ("gpu_manager_sigkill", "agent_sigkill", "dc_manager_sigkill")  # the router: router_sigkill()



def serving(pid: int | None) -> bool:
    """The process exists and runs (a stopped or zombie one answers nothing)."""
    return pid is not None and pid > 0 and cf.proc_state(pid) not in "TtZX"


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
    busy_s: dict[str, list[float]] = field(default_factory=dict)  # per kind: its injection until what it hit serves
    notes: list[str] = field(default_factory=list)


class Injectors:
    """Each fault kind's injection; an engine fault is given the model whose engine it hits."""

    def __init__(self, sc: Scenario, rng: random.Random, tally: Tally) -> None:
        self.sc = sc
        self.rng = rng
        self.tally = tally
        self.busy: set[str] = set()  # services chaos itself is killing and restarting (the supervisor leaves them)
        self.router_outages: list[tuple[float, float]] = []  # (killed, serving again) wall times
        self.resolved_at: dict[str, list[float]] = defaultdict(list)  # engine id -> its incidents' resolved times

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


    async def restart(self, name: str, *, kill: bool = True) -> None:
        """Kill `name` and start it again, as systemd would. One that exits again while starting (a router started
        while etcd restarts cannot connect, and exits 1) is the stack supervisor's to restart, with its backoff."""
        self.busy.add(name)
        try:
            if kill:
                self.stack.kill(name)  # restart() below waits for its exit
            await asyncio.to_thread(self.stack.restart, name)
        except Exception as e:  # noqa: BLE001 - noted; the supervisor restarts it, settle_after waits for that
            self.tally.notes.append(f"{name} exited while chaos restarted it: {type(e).__name__}: {e}")
        finally:
            self.busy.discard(name)

    async def listening(self, port: int) -> None:
        """Until something listens on `port` again (whichever restart, chaos's or the supervisor's, got it up)."""
        while True:
            if await asyncio.to_thread(procs.port_open, port):
                return
            await asyncio.sleep(0.05)

    async def active_engine(self, model: str, within_s: float = 0.0) -> EngineInfo | None:
        """The ready active engine of `model`; waited for up to `within_s` (a fault due while the previous one's
        effects settle, e.g. a store reconnecting after an etcd stall, lands once there is one, rather than being
        skipped)."""
        deadline = time.monotonic() + within_s
        while True:
            engine = await self._engine("active", model)
            if engine is not None or time.monotonic() >= deadline:
                return engine
            await asyncio.sleep(0.2)

    async def _engine(self, role: str, model: str) -> EngineInfo | None:
        try:
            engines = await self.sc.engines()
        except Exception:  # noqa: BLE001 - etcd may be restarting
            return None
        ok = ("ready",) if role == "active" else ("standby", "ready")
        found = [e for e in engines if e.role == role and e.model == model and e.state in ok and e.pid
                 and serving(e.pid)]
        return found[0] if found else None

    async def inject(self, fault: str, model: str, *, via_xid: bool = False) -> str | None:
        """Inject `fault` (an engine fault on `model`); the id of the engine it hit, if one."""
        self.tally.faults[fault] += 1
        if fault.startswith("engine_") and fault != "engine_sigkill_allocating":
            engine = await self._signal_engine(fault, model)
            return engine.engine_id if engine else None
        if fault in SERVICE_KILLS:
            await self.restart(fault.removesuffix("_sigkill"))
        elif fault == "controller_leader_sigkill":
            await self.restart(await self._leader_name())
        elif fault in ("nats_restart", "etcd_restart"):
            await self.restart(fault.removesuffix("_restart"), kill=False)
        elif fault == "engine_sigkill_allocating":
            await self.engine_sigkill_allocating(model, via_xid)
        elif fault in ("gpu_manager_fd_pressure", "admin_api_load"):
            return await getattr(self, fault)(model)
        else:
            await getattr(self, fault)()
        return None

    async def _signal_engine(self, fault: str, model: str) -> EngineInfo | None:
        engine = await self.active_engine(model, within_s=WAIT_FOR_TARGET_S)
        if engine is None or engine.pid is None:
            self._skip(fault, f"no ready engine of {model}")
            return None
        sig = {"engine_sigkill": signal.SIGKILL, "engine_sigstop": signal.SIGSTOP,
               "engine_cuda_error": signal.SIGUSR1}[fault]
        t_kill = time.time()
        os.kill(engine.pid, sig)  # SIGUSR1: the reference engine reports a fatal CUDA error and exits
        if fault == "engine_sigkill":
            await self._time_failover(fault, engine.engine_id, t_kill)
        return engine

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
            at = next((t for t in self.resolved_at.get(engine_id, ()) if t >= t_kill), None)
            if at is not None:
                self.tally.failover_ms.setdefault(fault, []).append(round((at - t_kill) * 1000, 1))
                return
            await asyncio.sleep(0.01)

    async def router_sigkill(self) -> None:
        down = time.time()
        self.router_outages.append((down, 0.0))
        await self.restart("router")
        await self.listening(self.stack.config.router_port)
        self.router_outages[-1] = (down, time.time())

    async def etcd_stall(self) -> None:
        etcd = self.stack.children["etcd"]
        stalled = self.rng.uniform(3.0, 15.0)
        self.busy.add("etcd")
        try:
            os.kill(etcd.pid, signal.SIGSTOP)
            await asyncio.sleep(stalled)  # the fault itself: etcd stopped for this long
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
            self.busy.discard("etcd")

    async def gpu_xid(self) -> None:
        xid = self.rng.choice((48, 63, 74, 79, 94, 95))
        on_gpu = await asyncio.to_thread(cf.EngineScan(self.state_dir).scan)
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
        await self._gpu_reset(0, on_gpu)

    async def _gpu_reset(self, gpu: int, on_gpu: set[int]) -> None:
        """What an operator does after an XID: the GPU reset, marked healthy again. The agent keeps a GPU that
        reported an XID unhealthy (nothing is placed on it) until then; on a one-GPU node the model would stay down
        for the rest of the run. Once the fault has taken the engines down (the agent marked the GPU before it
        killed them, so the reset cannot overtake the mark): every engine that ran on it is gone."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            if not any(procs.pid_alive(p) and cf.proc_state(p) not in "ZX" for p in on_gpu):
                break
            await asyncio.sleep(0.05)
        assert self.sc.bus is not None
        # asked again until the agent answers, as an operator would: the agent may be down or restarting (a fault
        # beside this one), and a reset asked once and lost left the one GPU failed, the models down, for the rest
        # of the run
        deadline = time.monotonic() + RESET_TRIES_S
        while True:
            try:
                await self.sc.bus.request(self.stack.config.node, MarkGpu(gpu=gpu, healthy=True,
                                                                          detail="chaos: GPU reset"),
                                          MarkGpuReply, timeout=15)
                return
            except Exception as e:  # noqa: BLE001 - noted once the tries are spent; settle() says the rest
                if time.monotonic() > deadline:
                    self.tally.notes.append(f"gpu reset not acknowledged: {type(e).__name__}: {e}")
                    return
                await asyncio.sleep(1.0)

    async def engine_sigkill_allocating(self, model: str, via_xid: bool) -> None:
        """Make an engine of `model` start (its standby killed, or every engine of the GPU lost to an XID) and
        SIGKILL the first new one while it holds an uncommitted lease."""
        loop = asyncio.get_running_loop()

        def leases_of(pid: int) -> dict[str, str | None]:
            engine = cf.engine_id_of(pid)
            if engine is None:
                return {}
            try:
                reply = asyncio.run_coroutine_threadsafe(self.sc.leases(), loop).result(10)
            except Exception:  # noqa: BLE001 - the gpu_manager is down (a fault beside this one): none seen now
                return {}
            return {lease.id: (str(lease.tag) if lease.state is LeaseState.ACTIVE and lease.layout_hash is None
                               else None)
                    for lease in reply.leases if lease.owner == engine}

        scan = cf.EngineScan(self.state_dir)
        before = await asyncio.to_thread(scan.scan, model)
        catch = asyncio.create_task(asyncio.to_thread(cf.catch_allocating, lambda: scan.scan(model), before,
                                                      leases_of))
        standby = None if via_xid else await self._engine("standby", model)
        if standby is not None and standby.pid:
            os.kill(standby.pid, signal.SIGKILL)
            trigger = "standby"
        else:
            await self.gpu_xid()
            trigger = "xid"
        out = await catch
        label = f"{out['result']}:{out.get('tag', '-')}"
        self.tally.allocating[label] += 1
        self.tally.allocating[f"trigger:{trigger}"] += 1

    async def gpu_manager_fd_pressure(self, model: str) -> str | None:
        """A hostile client holds many connections and asks for absurd leases; an engine of `model` is SIGKILLed
        under it (its successor must get its memory through the same manager), and the pressure holds until that
        engine's incident resolved."""
        hit: list[EngineInfo] = []

        async def kill_engine() -> None:
            engine = await self._signal_engine("engine_sigkill", model)
            hit.extend([engine] if engine else [])

        report = await cf.pressure(str(self.state_dir / "gpu_manager.sock"), kill_engine)
        for key, value in report.items():
            self.tally.pressure.setdefault(key, Counter())[str(value)] += 1
        if report.get("probe_after") != "ok":
            self.tally.manager_unserved += 1
            self.tally.notes.append(f"gpu_manager unserved after fd pressure: {report}")
        return hit[0].engine_id if hit else None

    async def admin_api_load(self, model: str) -> str | None:
        """Large bodies on the admin API (three loops, two without a token) while an engine's incident runs."""
        stop = asyncio.Event()
        statuses: Counter[str] = Counter()
        load = asyncio.create_task(cf.api_load(self.stack.api_url, self.stack.config.api_token,
                                               self.stack.config.node, stop, statuses=statuses))
        hit = None
        try:
            async with asyncio.timeout(WAIT_FOR_TARGET_S):  # the load is up: its first answers came back
                while True:
                    if sum(statuses.values()) >= len(cf.API_TARGETS):
                        break
                    await asyncio.sleep(0.02)
        except TimeoutError:
            self.tally.notes.append("admin_api_load: no answer to the large bodies within 60 s")
        engine = await self.active_engine(model, within_s=WAIT_FOR_TARGET_S)
        if engine is None or engine.pid is None:
            self._skip("admin_api_load", f"no ready engine of {model} to kill under the load")
        else:
            t_kill = time.time()
            os.kill(engine.pid, signal.SIGKILL)
            await self._time_failover("admin_api_load", engine.engine_id, t_kill)
            hit = engine.engine_id
        stop.set()
        self.tally.api_statuses.update(await load)
        return hit
