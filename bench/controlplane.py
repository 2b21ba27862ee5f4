"""Control-plane benchmark: real controller and dc_manager processes, simulated nodes, no engine work.

`holdfast bench controlplane --nodes N --gpus-per-node 8 --incidents 1000 --json`

The simulated nodes answer the real commands (freeze, takeover, spawn, reclaim) on NATS with the real
reply models, and their state (nodes, gpus, engines, leases) is written to etcd as the agent and the
gpu_manager would; only the engines themselves are absent. Every incident is one engine's FaultDetected;
its pipeline latency is from the fault's publication to the EndpointAdded that names its successor.
The simulated nodes are `devstack.simcluster.SimulatedCluster`, which the tests share.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

from devstack.simcluster import SimulatedCluster
from libs.common import procs
from libs.common.bus import Bus
from libs.common.cluster_view import range_pages
from libs.common.events import (
    EndpointAdded,
    IncidentResolved,
    event_subject,
)
from libs.common.gc_tuning import service_gc
from libs.common.ids import new_id
from libs.common.security.infra import SecureInfra
from libs.common.service import run_loop
from libs.common.store import Store

GIB = 1 << 30


# ---------------------------------------------------------------- the benchmark


def _service(module: str, env: dict[str, str], log_path: Path) -> procs.Child:
    return procs.Child(module, [sys.executable, "-m", module], env=env, log_path=log_path).start()


class ChildDied(RuntimeError):
    pass


def _check_alive(children: list[procs.Child]) -> None:
    """A dead service must end the run at once with its log, not leave the benchmark waiting."""
    for c in children:
        if not c.alive():
            tail = c.log_path.read_text(errors="replace")[-2000:] if c.log_path and c.log_path.exists() else ""
            raise ChildDied(f"{c.name} exited with {c.proc.returncode if c.proc else None}:\n{tail}")


async def _wait_health(bus: Bus, service: str, instance: str, children: list[procs.Child], timeout: float = 60) -> None:
    from libs.common.service import check_health

    deadline = time.monotonic() + timeout
    while True:
        _check_alive(children)
        try:
            await check_health(bus, service, instance, timeout=0.5)
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _inject(sim: SimulatedCluster, eids: list[str]) -> None:
    """Faults published together, their stream acks awaited together (the injector's own CPU is not the
    control plane's); a publish not acknowledged in time (an overloaded loop) is retried with the same
    envelopes (deduplicated by id)."""
    envs = [sim.bus.wired(sim.fault_event(eid), id=new_id()) for eid in eids]  # no Envelope model per fault
    for attempt in range(5):
        try:
            await sim.bus.publish_all(envs, timeout=10.0)
            return
        except Exception:  # noqa: BLE001 - nats timeout under load
            if attempt == 4:
                raise


async def _stored(bus: Bus, subject: str) -> int:
    """How many messages the stream holds on `subject` (every publish is kept: 24 h, 1 M messages)."""
    full = f"{bus.prefix}.{subject}"
    info = await bus.js.stream_info(bus.settings.stream_name, subjects_filter=full)
    return (info.state.subjects or {}).get(full, 0)


async def _ends(bus: Bus, died: dict[str, float]) -> dict[str, float]:
    """Incident id -> seconds from its engine's fault to its incident.resolved's publication (the envelope's time;
    published once its record is in etcd), read back from the stream, for the faults in `died`."""
    ends: dict[str, float] = {}
    for env in await bus.replay("incident.resolved"):
        data = env.data
        if isinstance(data, IncidentResolved) and data.engine_id in died and data.incident_id not in ends:
            ends[data.incident_id] = env.time - died[data.engine_id]
    return ends


def _mid_rate(times: list[float]) -> float | None:
    if len(times) < 10:
        return None
    lo, hi = int(0.1 * len(times)), int(0.9 * len(times))
    return round((hi - lo) / max(times[hi] - times[lo], 1e-9), 1)


def _pct(lat: list[float], p: float) -> float | None:
    return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) if lat else None


def _windows(by_death: list[tuple[float, float]], start: float, width: float) -> list[float | None]:
    """p99 latency (ms) of the faults due in each `width` seconds from `start`."""
    buckets: dict[int, list[float]] = {}
    for died, latency in by_death:
        buckets.setdefault(int((died - start) // width), []).append(latency)
    return [_pct(sorted(buckets.get(i, [])), 0.99) for i in range(max(buckets, default=-1) + 1)]


async def run_bench(nodes: int, gpus_per_node: int, incidents: int, workdir: Path, *, rate: float = 0.0,
                    dc_managers: int = 1, secure: bool = True) -> dict[str, Any]:
    """Burst (`rate` 0: every fault at once) or steady (`rate` faults/s, spread evenly) through the pipeline.
    `secure`: NATS and etcd with auth and TLS, as the stack runs them (the simulated nodes connect as `admin`)."""
    nats_port, etcd_port, peer = procs.free_port(), procs.free_port(), procs.free_port()
    sec = SecureInfra(workdir / "state" / "credentials", [], secure)
    settings = sec.settings(nats_url=f"nats://127.0.0.1:{nats_port}", etcd_endpoints=f"127.0.0.1:{etcd_port}",
                            state_dir=workdir / "state")
    infra = [procs.nats_server(nats_port, workdir / "nats", workdir / "nats.log",
                               config=sec.nats_config(workdir / "nats.conf", settings)).start(),
             procs.etcd_server(etcd_port, peer, workdir / "etcd", workdir / "etcd.log", tls_flags=sec.etcd_flags()).start()]
    children = list(infra)
    try:
        procs.wait_port(nats_port, infra[0])
        procs.wait_port(etcd_port, infra[1])
        sec.etcd_ready(etcd_port, settings)
        env = {**sec.env(), "HF_NATS_URL": settings.nats_url, "HF_ETCD_ENDPOINTS": settings.etcd_endpoints,
               "HF_STATE_DIR": str(settings.state_dir), "HF_LOG_LEVEL": "WARNING", "HF_API_ENABLED": "false",
               "HF_INSTANCE": "c1", "HF_DATACENTER": "dc-1", "HF_REATTACH_DEADLINE_S": "120",
               "HF_FREEZE_DEADLINE_S": "120", "HF_TAKEOVER_TIMEOUT_S": "120", "HF_FREEZE_TIMEOUT_S": "60"}
        # The default leader ttl (3 s): the lease is refreshed from its own thread, a busy loop keeps it.
        bus = await Bus.connect(settings, "bench")
        store = await Store.connect(settings)
        sim = SimulatedCluster(bus, store, nodes, gpus_per_node, record=False, emit_events=False)
        t0 = time.perf_counter()
        await sim.populate()
        populate_s = time.perf_counter() - t0
        service_gc()  # the simulated cluster's 8,000 engines and leases live as long as the run, like a service's view
        await sim.serve()
        services = [_service("services.controller", env, workdir / "controller.log")]
        for i in range(dc_managers):
            # Several managers of one datacenter share its durable consumer: each intent goes to one of them.
            services.append(_service("services.dc_manager", {**env, "HF_DATACENTER": "dc-1", "HF_NODE": f"dcm{i}"},
                                     workdir / f"dc_manager{i}.log"))
        children += services
        await _wait_health(bus, "controller", "c1", children)
        await _wait_health(bus, "dc_manager", "dc-1", children)
        while await store.get("leader/controller") is None:  # noqa: ASYNC110 - polling etcd
            _check_alive(children)
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the leader's durable consumers are bound

        # Engines ready to fail, oldest first. A steady run longer than one failure per engine fails successors
        # again: each successor joins the queue when its EndpointAdded arrives, as a served engine would.
        ready = collections.deque(list(sim.engines)[:incidents] if rate <= 0 else sim.engines)
        total = min(incidents, len(ready)) if rate <= 0 else incidents
        starved = 0  # steady mode: faults due when no engine was ready (every one in an incident: far behind)
        died: dict[str, float] = {}
        latencies: list[float] = []
        by_death: list[tuple[float, float]] = []  # (when the fault was due, its latency): the latency over the run
        resolved_at: list[float] = []  # when each successor was announced, in arrival order
        seen: set[str] = set()
        done = asyncio.Event()

        async def on_added(msg: Any) -> None:
            # Only the predecessor's id is read (json, not the whole envelope validated and its trace attached:
            # the measuring side's CPU is counted with the simulated nodes').
            now = time.time()
            data = json.loads(msg.data).get("data") or {}
            pred = data.get("predecessor_id")
            if pred in died and pred not in seen:
                seen.add(pred)
                latencies.append(now - died[pred])
                by_death.append((died[pred], now - died[pred]))
                resolved_at.append(now)
                if data.get("engine_id") in sim.engines:
                    ready.append(data["engine_id"])
                if len(latencies) == total:
                    done.set()

        await bus.nc.subscribe(event_subject(bus.prefix, EndpointAdded), cb=on_added)
        # Incident ends (incident.resolved) are not delivered to this process during the run either: read back
        # from the stream after it, each timed by its envelope's time (8,000 more messages through nats-server
        # and this loop otherwise, counted with the simulated nodes).
        ends0 = await _stored(bus, "incident.resolved")
        # Intent results published (one or two per incident): counted by the stream at the end, not delivered to
        # this process (8,000 more messages through nats-server and this loop, counted with the simulated nodes).
        results0 = await _stored(bus, "intent.result")
        pids = {"controller": services[0].pid, "etcd": infra[1].pid, "nats": infra[0].pid,
                **{f"dc_manager{i}": c.pid for i, c in enumerate(services[1:])}}
        _, rev0 = await range_pages(store, "leader/")  # every etcd write (a transaction) adds one revision
        cpu0 = {k: _cpu_s(p) for k, p in pids.items()}
        bench_cpu0 = time.process_time()
        start = time.time()
        offered, planned = 0, total
        while offered < planned:
            # Burst: 200 at a time, all at once. Steady: fault i is due at start + i / rate; what is due every 5 ms.
            due = min(planned, offered + 200 if rate <= 0 else int((time.time() - start) * rate) + 1)
            batch = [ready.popleft() for _ in range(min(due - offered, len(ready)))]
            short = due - offered - len(batch)
            starved, total, offered = starved + short, total - short, due  # the run's incidents: those injected
            for eid in batch:
                died[eid] = time.time()
            if batch:
                await _inject(sim, batch)
            if rate > 0:
                await asyncio.sleep(0.005)
        injected = time.time()
        if len(latencies) >= total:  # the last faults due found no engine ready: nothing more to wait for
            done.set()
        wait_s = max(60.0, total / 20)
        while not done.is_set() and time.time() - injected < wait_s:
            _check_alive(children)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=1.0)
        end = time.time()
        for _ in range(50):  # the last ends follow their endpoints by one etcd write
            if await _stored(bus, "incident.resolved") - ends0 >= len(latencies):
                break
            await asyncio.sleep(0.1)
        cpu = {k: round(_cpu_s(p) - cpu0[k], 2) for k, p in pids.items()}
        cpu["bench (fault injection, simulated nodes)"] = round(time.process_time() - bench_cpu0, 2)
        _, rev1 = await range_pages(store, "leader/")
        from libs.common.service import check_health

        controller = (await check_health(bus, "controller", "c1", timeout=5)).detail
        results = await _stored(bus, "intent.result") - results0
        ends = await _ends(bus, died)
        await bus.close()
        await store.close()
        lat = sorted(latencies)
        return {
            "mode": "burst" if rate <= 0 else "steady", "offered_per_s": rate if rate > 0 else None,
            "nodes": nodes, "gpus_per_node": gpus_per_node, "engines": nodes * gpus_per_node,
            "dc_managers": dc_managers, "incidents": total, "resolved": len(lat),
            "engines_failed_again": max(0, total - nodes * gpus_per_node), "starved": starved,
            "populate_s": round(populate_s, 2), "inject_s": round(injected - start, 3),
            "wall_s": round(end - start, 3),
            "incidents_per_s": round(len(lat) / (end - start), 1) if lat else 0.0,
            # The completion rate between the 10th and the 90th percentile completion: in steady mode, the rate
            # served while the load is offered (incidents_per_s also counts the first fault's and the last
            # one's latency, so a pipeline that keeps up at 1,000/s shows 8,000 / (8 s + its latency) there).
            "served_per_s_mid": _mid_rate(resolved_at),
            "latency_ms": {"p50": _pct(lat, 0.50), "p90": _pct(lat, 0.90), "p99": _pct(lat, 0.99), "max": _pct(lat, 1.0)},
            # Fault -> incident.resolved: the successor's endpoint goes out first; the end waits for its record.
            "end_latency_ms": {"heard": len(ends), "p50": _pct(sorted(ends.values()), 0.50),
                               "p99": _pct(sorted(ends.values()), 0.99)},
            # Steady mode: p99 of the faults of each 10 s of the run: flat when the pipeline keeps up, rising
            # when a backlog builds (a whole run's p99 cannot tell the two apart).
            "p99_ms_by_10s": _windows(by_death, start, 10.0) if rate > 0 else None,
            "cpu_s": cpu, "cpu_ms_per_incident": round(sum(cpu.values()) * 1000 / max(1, len(lat)), 2),
            "etcd_transactions": rev1 - rev0, "intent_results": results, "records_not_written": controller.get("records_not_written"), "controller_gc_paused_ms": controller.get("gc_paused_ms"),
            # Ended incidents whose records the controller keeps (its retention deletes the older ones).
            "ended_incidents_kept": controller.get("ended_incidents"), "freeze_calls": sim.freeze_calls, "takeover_calls": sim.takeover_calls,
            "cpus": os.cpu_count(),
        }
    finally:
        for c in reversed(children):
            c.stop()


async def messaging_floor(workdir: Path, n: int = 8000) -> dict[str, dict[str, float]]:
    """CPU per message of bare nats-py on this machine (no pydantic, no tracing, no logic): what an incident's
    messages cost at the least, and the ways the bus could use it side by side (docs/bus.md): a pull consumer read
    with nats-py's `fetch` or with requests of its own on a callback inbox; commands by nats-py's `request` or on
    one inbox. Client and nats-server CPU in microseconds per message."""
    import nats
    from nats.js.api import AckPolicy, StreamConfig

    port = procs.free_port()
    srv = procs.nats_server(port, workdir / "floor-nats", workdir / "floor-nats.log").start()
    out: dict[str, dict[str, float]] = {}
    try:
        procs.wait_port(port, srv)
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="FLOOR", subjects=["f.>"]))
        body = json.dumps({"type": "fault.detected", "data": {"engine_id": "n0001-g1-e0", "pad": "x" * 300}}).encode()

        async def measure(name: str, run: Any) -> None:
            c0, s0 = time.process_time(), _cpu_s(srv.pid)
            await run()
            out[name] = {"client_us": round((time.process_time() - c0) / n * 1e6, 1),
                         "nats_server_us": round((_cpu_s(srv.pid) - s0) / n * 1e6, 1)}

        async def publish() -> None:  # JetStream publish, stream ack awaited, 200 in flight
            for i in range(0, n, 200):
                await asyncio.gather(*(js.publish("f.a", body, headers={"Nats-Msg-Id": f"a{j}"}) for j in range(i, i + 200)))

        async def consume() -> None:  # push durable, explicit ack of each
            left, done = [n], asyncio.Event()

            async def cb(msg: Any) -> None:
                await msg.ack()
                left[0] -= 1
                if not left[0]:
                    done.set()
            await js.subscribe("f.a", durable="floor", cb=cb, manual_ack=True)
            await done.wait()

        async def fetch() -> None:  # pull durable read with nats-py's fetch(batch=200), explicit ack of each
            psub = await js.pull_subscribe("f.a", durable="floor-fetch", stream="FLOOR")
            left = n
            while left > 0:
                for msg in await psub.fetch(batch=min(200, left), timeout=5):
                    await msg.ack()
                    left -= 1

        async def pull_requests() -> None:  # pull durable read as the bus does: own MSG.NEXT requests, a callback
            await js.add_consumer("FLOOR", durable_name="floor-pull", ack_policy=AckPolicy.EXPLICIT)
            left, done, filled = [n], asyncio.Event(), asyncio.Event()
            inbox = nc.new_inbox()

            async def cb(msg: Any) -> None:
                if msg.headers and "Status" in msg.headers:
                    filled.set()
                    return
                await msg.ack()
                left[0] -= 1
                if left[0] % 200 == 0:
                    filled.set()
                if not left[0]:
                    done.set()
            await nc.subscribe(inbox, cb=cb)
            while not done.is_set():
                filled.clear()
                await nc.publish("$JS.API.CONSUMER.MSG.NEXT.FLOOR.floor-pull",
                                 json.dumps({"batch": 200, "expires": 5_000_000_000}).encode(), reply=inbox)
                await filled.wait()

        async def request() -> None:  # request/reply, both sides in this process
            async def answer(msg: Any) -> None:
                await msg.respond(body)
            await nc.subscribe("f-cmd", cb=answer)
            for _ in range(0, n, 200):
                await asyncio.gather(*(nc.request("f-cmd", body, timeout=10) for _j in range(200)))

        async def request_inbox() -> None:  # request/reply as the bus's request_all: one inbox, a token a reply
            prefix = nc.new_inbox() + "."
            waiting: dict[str, Any] = {}
            left, round_done = [0], asyncio.Event()

            async def on_reply(msg: Any) -> None:
                waiting.pop(msg.subject[len(prefix):], None)
                left[0] -= 1
                if not left[0]:
                    round_done.set()
            await nc.subscribe(prefix + "*", cb=on_reply)
            for i in range(0, n, 200):
                round_done.clear()
                left[0] = 200
                for j in range(i, i + 200):
                    waiting[str(j)] = True
                    await nc.publish("f-cmd", body, reply=prefix + str(j))
                await round_done.wait()

        # Each durable read reads the same n stored messages through a consumer of its own.
        for name, run in (("js_publish_acked", publish), ("durable_consume_ack", consume),
                          ("pull_fetch_ack", fetch), ("pull_requests_ack", pull_requests),
                          ("request_reply", request), ("request_inbox", request_inbox)):
            await measure(name, run)
        await nc.close()
    finally:
        srv.stop()
    return out


def cli(nodes: int = 10, gpus_per_node: int = 8, incidents: int = 1000,
        rate: float = typer.Option(0.0, help="steady mode: offered faults per second (0: burst, all at once)"),
        duration: float = typer.Option(0.0, help="steady mode: seconds of offered load (incidents = rate x duration; "
                                       "past one per engine, successors fail again)"),
        dc_managers: int = typer.Option(1, help="dc_manager processes sharing the datacenter's intents"),
        json_out: bool = typer.Option(False, "--json"),
        secure: bool = typer.Option(True, help="auth and TLS on NATS and etcd (--no-secure: to measure their cost)"),
        floor: bool = typer.Option(False, help="only measure bare nats-py CPU per message (the messaging floor)")) -> None:
    """Incidents per second and pipeline latency of the real controller and dc_manager on simulated nodes.

    Burst mode fires every fault at once (throughput; latency is mostly queueing). Steady mode offers
    `--rate` faults/s for `--duration` s: if the pipeline keeps up, its p99 is the pipeline's own latency. A steady
    run may outlast one failure per engine: each successor, once announced, is failed again in its turn (oldest
    first), so that a long run measures a sustained rate, not the first 8,000 incidents.
    """
    if rate > 0 and duration > 0:
        incidents = int(rate * duration)
    if rate <= 0:
        incidents = min(incidents, nodes * gpus_per_node)  # a burst fails each engine once, all at once
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the child processes are stopped
    if floor:
        with tempfile.TemporaryDirectory(prefix="hf-bench-floor-") as d:
            print(json.dumps(run_loop(messaging_floor(Path(d)))))
        return
    with tempfile.TemporaryDirectory(prefix="hf-bench-cp-") as d:
        result = run_loop(run_bench(nodes, gpus_per_node, incidents, Path(d), rate=rate, dc_managers=dc_managers,
                                     secure=secure))
    if json_out:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="control plane: incidents through the real controller and dc_manager")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
    Console().print(table)


if __name__ == "__main__":
    typer.run(cli)
