"""Engines a dead agent started and never recorded: when they register with its successor they are adopted into
their spec only if it has room, else refused and ended, so a spec never runs more actives than its `replicas`
(README invariant 11; a CI chaos run once counted 21 samples over the cap: the agent died as etcd did, its
restart started replacements, then adopted the first engines as they registered)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from libs.common import procs
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import (
    EngineInfo,
    EngineRole,
    EngineSpec,
    ListEngines,
    ListEnginesReply,
    Spawn,
    SpawnReply,
)
from libs.common.store import Store
from tests.agent.conftest import ROOT, AgentProcess, Recorder, engine_records, kill_engines_of, pattern_spec
from tests.conftest import start_etcd
from tests.support import wait_until

# The first engine of the spec waits for the test's gate file before it runs the pattern engine (so, before it
# registers); the later ones run at once. Alive and well, only late.
GATED_FIRST = ("import os, runpy, sys, time\n"
               "gate = sys.argv[1]\n"
               "if not os.path.exists(gate + '.taken'):\n"
               "    open(gate + '.taken', 'w').close()\n"
               "    while not os.path.exists(gate):\n"
               "        time.sleep(0.02)\n"
               "sys.argv = ['engines.pattern']\n"
               "runpy.run_module('engines.pattern', run_name='__main__', alter_sys=True)\n")


def gated_spec(gate: Path) -> EngineSpec:
    return EngineSpec(engine_class="pattern", model="gated-m", command=[sys.executable, "-c", GATED_FIRST, str(gate)],
                      env={"HF_PATTERN_HEARTBEAT_S": "0.05"}, replicas=1, standbys=0, cold_start_s=30.0)


class OwnEtcd:
    """An etcd of this test's own, which it stops (SIGSTOP) while the agent starts an engine: that engine's record is
    then never written, as when a chaos run killed etcd under the agent."""

    def __init__(self, credentials: Path, tmp_path: Path) -> None:
        port, peer = procs.free_port(), procs.free_port()
        self.endpoint = f"127.0.0.1:{port}"
        self.child = start_etcd(port, peer, tmp_path / "etcd", tmp_path / "etcd.log", credentials)

    def pause(self) -> None:
        os.kill(self.child.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.child.pid, signal.SIGCONT)


@pytest.fixture
def own_etcd(credentials: Path, tmp_path: Path) -> Iterator[OwnEtcd]:
    etcd = OwnEtcd(credentials, tmp_path)
    yield etcd
    etcd.resume()
    etcd.child.stop()


@pytest.fixture
async def own(settings: CommonSettings, own_etcd: OwnEtcd, tmp_path: Path
              ) -> AsyncIterator[tuple[AgentProcess, Store, CommonSettings]]:
    """A real agent on this test's etcd (the `agent` fixture's, otherwise), and a store client of that etcd."""
    mine = settings.model_copy(update={"etcd_endpoints": own_etcd.endpoint})
    proc = AgentProcess(mine, mine.to_env(), tmp_path)
    store = await Store.connect(mine)
    yield proc, store, mine
    proc.stop()
    kill_engines_of(str(mine.state_dir / "agent.sock"))
    await store.close()


async def _live_actives(bus: Bus) -> list[EngineInfo]:
    listed = (await bus.request("node-1", ListEngines(), ListEnginesReply)).engines
    return [e for e in listed if e.role is EngineRole.ACTIVE and e.state in ("starting", "ready", "assigned")]


def _engine_pids(settings: CommonSettings) -> list[int]:
    """The live engine processes of this test's agent socket (its engines carry it in their environment)."""
    pids = procs.pids_with_env("HF_AGENT_SOCKET", str(settings.state_dir / "agent.sock"), having=("HF_ENGINE_ID",))
    return sorted(p for p in pids if procs.pid_alive(p))


@dataclass
class Stranded:
    agent: AgentProcess
    store: Store
    settings: CommonSettings
    spec: EngineSpec
    stranger: EngineInfo  # started by the killed agent, not recorded, not registered
    stranger_pid: int
    gate: Path  # the stranger registers once this file exists


@pytest.fixture
async def stranded(own: tuple[AgentProcess, Store, CommonSettings], own_etcd: OwnEtcd, bus: Bus,
                   tmp_path: Path) -> Stranded:
    """The agent starts the first engine of a gated spec while etcd does not answer, and is SIGKILLed before it
    could record it (or the spec): the engine runs on, known to nobody, and registers once the gate exists."""
    agent, store, settings = own
    gate = tmp_path / "gate"
    spec = gated_spec(gate)
    agent.start([])
    await agent.wait_up(store)
    own_etcd.pause()
    try:
        started = (await bus.request("node-1", Spawn(spec=spec), SpawnReply)).engine
        agent.kill(signal.SIGKILL)
    finally:
        own_etcd.resume()
    assert started.pid is not None and procs.pid_alive(started.pid)
    assert started.engine_id not in await engine_records(store)
    return Stranded(agent, store, settings, spec, started, started.pid, gate)


async def test_an_unrecorded_engine_registering_after_its_replacement_is_refused_and_ends(
        stranded: Stranded, recorder: Recorder, bus: Bus) -> None:
    agent, store, stranger = stranded.agent, stranded.store, stranded.stranger
    agent.start([stranded.spec])  # the restarted agent: no record of the stranger, so it starts the spec's one replica
    await agent.wait_up(store)
    replacement = (await recorder.wait("engine.ready", lambda e: e.engine.engine_id != stranger.engine_id,
                                       within_s=30)).engine
    stranded.gate.touch()  # now the stranger registers: one active too many

    async def settled() -> bool:  # adopted (listed), or gone
        listed = {e.engine_id for e in (await bus.request("node-1", ListEngines(), ListEnginesReply)).engines}
        return stranger.engine_id in listed or not procs.pid_alive(stranded.stranger_pid)
    await wait_until(settled, within_s=30, what="the stranger registered")

    assert not procs.pid_alive(stranded.stranger_pid), "the refused engine still runs"
    assert [e.engine_id for e in await _live_actives(bus)] == [replacement.engine_id]
    assert _engine_pids(stranded.settings) == [replacement.pid]
    records = await engine_records(store)
    assert [k for k, r in records.items() if r.role is EngineRole.ACTIVE and r.state in ("starting", "ready")] == [
        replacement.engine_id]
    assert not recorder.of("engine.ready", lambda e: e.engine.engine_id == stranger.engine_id)
    assert "one too many" in (agent.log_dir / "agent.log").read_text()


async def test_an_unrecorded_engine_registering_first_holds_its_slot_and_nothing_more_starts(
        stranded: Stranded, recorder: Recorder, bus: Bus) -> None:
    # The reverse order: the stranger is let go while no agent runs, so it registers as soon as the new agent
    # listens, whether before its first reconcile or after; either way one active engine of the spec runs after.
    stranger, settings = stranded.stranger, stranded.settings
    stranded.gate.touch()
    stranded.agent.start([stranded.spec])
    await stranded.agent.wait_up(stranded.store)
    first = (await recorder.wait("engine.ready", within_s=30)).engine

    async def one_left() -> list[EngineInfo] | None:
        live = await _live_actives(bus)
        alone = len(live) == 1 and live[0].state == "ready" and len(_engine_pids(settings)) == 1
        return live if alone else None
    live = await wait_until(one_left, within_s=30, what="one active engine")
    assert live[0].engine_id == first.engine_id
    if first.engine_id == stranger.engine_id:  # adopted into its spec: the reconciler counts it
        assert live[0].spec_key is not None
        assert not [e for e in recorder.of("engine.started") if e.engine.engine_id != stranger.engine_id]
    else:
        assert not procs.pid_alive(stranded.stranger_pid)


STUBBORN = textwrap.dedent("""
    import os, signal, socket, sys, time
    sys.path.insert(0, sys.argv[2])
    from libs.common import wire
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an engine that neither exits on a refusal nor on SIGTERM
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sys.argv[1])
        wire.send_frame(s, {"op": "register", "engine_id": "stray-1", "pid": os.getpid(), "role": "active",
                            "model": "pattern-m", "engine_class": "pattern", "version": "1", "state": "ready"})
        reply, _ = wire.recv_frame(s)
        print(reply.get("op"), reply.get("code"), flush=True)
    while True:
        time.sleep(1)
""")


async def test_a_stranger_refused_for_its_full_spec_is_ended_even_when_it_ignores_sigterm(
        agent: AgentProcess, recorder: Recorder, bus: Bus, settings: CommonSettings, tmp_path: Path) -> None:
    agent.start([pattern_spec()], stop_timeout_s=1.0)
    active = (await recorder.wait("engine.ready", within_s=30)).engine
    out = tmp_path / "stubborn.out"
    with out.open("wb") as f:
        stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN, str(settings.state_dir / "agent.sock"),
                                     str(ROOT)], stdout=f, stderr=subprocess.STDOUT)
    try:
        code = await wait_until(lambda: stubborn.poll(), within_s=30, what="the stubborn engine ended")
        assert code == -signal.SIGKILL  # its SIGTERM ignored, the agent's SIGKILL followed
        assert out.read_text().split() == ["error", "conflict"]
        assert [e.engine_id for e in await _live_actives(bus)] == [active.engine_id]
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()
