"""Wiring of the agent: records, re-adoption, the engines' socket, the node key, NVML, commands, loops."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from libs.common import wire
from libs.common.backoff import Backoff
from libs.common.events import ListEngines, MarkGpu, NodeInfo, Spawn, StopEngine, Takeover
from libs.common.gc_tuning import long_lived_gc
from libs.common.metrics_http import serve_metrics
from libs.common.service import Runtime
from libs.common.terms import current_term
from services.agent import protocol, records
from services.agent.commands import Commands
from services.agent.incident_ends import follow_incident_ends
from services.agent.link_server import make_handler
from services.agent.metrics import AgentMetrics, MeteredAgent
from services.agent.nvml import NvmlWatcher
from services.agent.settings import AgentSettings
from services.agent.supervision import spec_key
from services.agent.takeover import Takeovers

log = logging.getLogger("holdfast.agent")


async def setup(rt: Runtime) -> None:
    settings: AgentSettings = rt.settings  # type: ignore[assignment]
    settings.ensure_state_dir()
    writer = records.RecordWriter(rt.store)
    rt.spawn("records", writer.run())
    metrics = AgentMetrics()
    agent = MeteredAgent(settings, rt.bus, writer, metrics=metrics)
    rt.on_close(agent.close)

    # Specs: those received over NATS earlier (etcd), then the configured ones (config wins).
    agent.specs.update(await records.load_specs(rt.store, settings.node))
    for spec in settings.load_specs():
        agent.specs[spec_key(spec)] = spec
        # recorded too: the dc_manager's cold-start fallback finds an engine class's spec there
        writer.put_spec(settings.node, spec_key(spec), spec)

    # Faults wait for the node key (detection.py): one seen while nodes/<node> is absent reads "node gone" to the
    # control plane, which then forgoes the reattach in place (the live memory, the waiting standby).
    agent.detection.hold_faults()
    # Engines still running from a previous agent on this node, before anyone can register.
    for info in await records.load_engines(rt.store, settings.node):
        agent.adoption.readopt(info)

    # Before the first engine registers: a standby the previous agent assigned resumes its takeover as it registers.
    takeovers = Takeovers(agent)
    agent.resumer = takeovers.resume
    if settings.marks_on():  # the mark waiter up before the first engine registers (mark_waiter.py)
        agent.watcher.start_marks()
    # small limits until a frame's op is known (link_server.py rule 4): a register, with its death mark's one fd
    server = await wire.serve_frames(str(settings.socket_path()), make_handler(agent.links, settings),
                                     mode=settings.socket_mode, max_size=protocol.MAX_REGISTER_BYTES,
                                     max_fds=protocol.MAX_REGISTER_FDS)
    rt.on_close(server.close)
    # Engines a previous agent started and never recorded register again now: they fill their slots first.
    agent.starts_from = time.monotonic() + settings.stranger_wait_s

    health = agent.gpu_health  # the node's GPUs: NVML's, or the configured simulated ones
    nvml = NvmlWatcher(health.nvml_fault)
    has_nvml = settings.nvml and nvml.start(asyncio.get_running_loop())
    if has_nvml:
        health.gpus = nvml.entries_of(settings.gpus)  # the real GPUs (else the simulated ones of the config)
    # GPUs that failed before this agent started (the gpu_manager keeps them failed): no engine is placed there.
    health.unhealthy.update(await records.load_failed_gpus(rt.store, settings.node, health.gpus))
    # Health a previous agent wished and the manager never answered: newer than the manager's marks, sent again.
    health.resume()
    rt.on_close(_async(nvml.stop))

    node = NodeInfo(node=settings.node, datacenter=settings.datacenter, agent_pid=os.getpid(),
                    agent_socket=str(settings.socket_path()), started_at=time.time(),
                    # no GPU seen (the host backend): its one memory pool is "gpu 0", where engines run
                    gpus=[g.index for g in health.gpus], nvml=bool(has_nvml))
    commands = Commands(agent, lambda: current_term(rt.store))
    agent.promoter = takeovers.promote
    await rt.bus.serve(settings.node, Spawn, commands.spawn)
    await rt.bus.serve(settings.node, StopEngine, commands.stop)
    await rt.bus.serve(settings.node, ListEngines, commands.list_engines)
    await rt.bus.serve(settings.node, Takeover, takeovers.handle)
    await rt.bus.serve(settings.node, MarkGpu, health.mark_gpu)
    # The node key says "up": whoever sees it may send commands at once, so it is written after every command
    # is served (serve returns once the server routes to it), never beside them.
    # The faults held since the start (re-adopted engines that died meanwhile) go out once it is written.
    rt.spawn("node-key", _keep_node_key(rt, node, settings.node_ttl_s, agent.detection.release_faults))

    rt.spawn("monitor", agent.detection.monitor_loop())
    rt.spawn("probes", agent.probes.loop())
    rt.spawn("exiting", agent.detection.exiting_loop())
    rt.spawn("reconcile", agent.reconcile_loop())
    ends = follow_incident_ends(agent, rt.store, settings.reconcile_interval_s, settings.takeover_wait_s)
    rt.spawn("incident-ends", ends)
    metrics_port = serve_metrics(rt, metrics.registry, settings.metrics_host, settings.metrics_port)
    rt.health_detail = lambda: {
        "metrics_port": metrics_port,
        "engines": {r.engine_id: r.state.value for r in agent.records()},
        "faults_published": agent.detection.faults_published,
        "promoted_here": takeovers.promoted,
        "refused_stale_term": commands.refused,
        "backoff": {b.spec_key: b.model_dump() for b in agent.backoff_report()},
        "nvml": bool(has_nvml),
        "socket": str(settings.socket_path()),
    }
    agent.reconcile_soon()
    # Everything imported and built so far lives as long as the process: out of the collector's sight, a
    # full collection no longer walks it (one measured 17-25 ms, landing inside a takeover's reply).
    long_lived_gc()


def _async(fn):  # noqa: ANN001, ANN202 - adapts a plain closer to Runtime.on_close
    async def run() -> None:
        fn()

    return run


async def _keep_node_key(rt: Runtime, node: NodeInfo, ttl: int, written: Callable[[], None]) -> None:
    """nodes/<node> bound to our etcd lease; a lost lease (etcd partition) is re-granted and re-written, and while
    etcd does not answer that is tried again with backoff: an etcd outage never ends the agent (a chaos run's etcd
    kill once did, at the grant, and the engines it had just started, not yet registered, came back as strangers
    beside their replacements). `written` is called each time the key is in etcd."""
    backoff = Backoff(first_s=0.2, max_s=5.0, jitter=0.2)
    while True:
        try:
            lease, keepalive = await records.register_node(rt.store, node, ttl)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - etcd unreachable or slow: temporary, try again
            delay = backoff.next_delay()
            log.warning("cannot register node %s in etcd (%s: %s); again in %.1f s", node.node, type(e).__name__, e,
                        delay)
            await asyncio.sleep(delay)
            continue
        backoff.reset()
        written()
        task = asyncio.create_task(keepalive.run(), name="node-lease-keepalive")
        try:
            await keepalive.lost.wait()
            log.error("node lease lost; registering the node again")
        finally:
            task.cancel()
            if rt.stopping.is_set():
                await rt.store.revoke(lease)  # a clean stop removes the node at once

