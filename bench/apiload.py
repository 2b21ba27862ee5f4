"""API-load benchmark: does traffic on the admin REST API delay the incident pipeline?

`holdfast bench apiload --incidents 40 --loops 3 --json`

A real controller (admin API on) and dc_manager on simulated nodes (`bench.controlplane.SimulatedCluster`).
Incidents are injected one at a time (a fault, then its successor's `EndpointAdded`: fault-to-resolved); the
same count is run three times in one run:
1. `without_load`: nothing else runs;
2. `load_on_dummy`: `loops` attacker processes hammer a dummy API server, a separate process on the same machine
   serving the controller's own API app (`create_app`, its guard, routes and validation, over an empty view), so
   the attackers' requests cost it what they cost the controller's API: what the pipeline loses here is machine
   contention (2 shared cores), not the controller's own delay;
3. `load_on_controller`: the same attackers aimed at the controller's API.
The controller's own share of the delay is phase 3 against phase 2, not against phase 1.
Each attacker cycles through three requests: no token and a `body_mb` body (the guard must refuse it unread: 401),
the admin token and a `body_mb` body (413), and the admin token with a JSON body just under the limit (read and
parsed, then refused by validation: 422). Reported side by side: p50/p99/max of each phase, the attackers'
requests by answer and per second, the cores the controller, the dummy and the attackers used, and the
controller's RSS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import select
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:  # the rest is imported in run_bench: an attacker process (spawned) imports this module only
    from bench.controlplane import SimulatedCluster
    from libs.common import procs

TOKEN = "bench-admin"
LIMIT = 1 << 20  # the controller's default api_max_body_bytes


def _request(port: int, headers: str, body_len: int, body: bytes | None = None) -> str:
    """One POST of `body_len` bytes (or `body`), sent until the server answers; returns the status code
    (or what went wrong). Blocking sends: an attacker waits on the socket, it does not spin on the CPU."""
    chunk = memoryview(body if body is not None else b"x" * (256 << 10))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(f"POST /v1/engines/none/failover HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/json\r\n"
                      f"Content-Length: {body_len}\r\nConnection: close\r\n\r\n".encode())
            sent = 0
            with contextlib.suppress(OSError):  # the server answered and closed: the answer is read below
                while sent < body_len and not select.select([s], [], [], 0)[0]:
                    part = chunk[sent:sent + (256 << 10)] if body is not None else chunk[: min(len(chunk), body_len - sent)]
                    sent += s.send(part)
            answer = s.recv(64)
            return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "no answer"
    except OSError as e:
        return type(e).__name__


def attack(port: int, body_mb: int, near_limit: bool, stop: Any, counts: Any) -> None:
    """An attacker process: the three requests in turn until `stop` is set; says when it has made its first
    round (so the measured phase starts under full load), then its answers by status at the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    near = json.dumps({"successor": "x" * (LIMIT - 64)}).encode()
    big = body_mb << 20
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    mine: dict[str, int] = {}
    rounds = 0
    while not stop.is_set():
        kinds = [("", big, None), (auth, big, None)] + ([(auth, len(near), near)] if near_limit else [])
        for headers, n, body in kinds:
            status = _request(port, headers, n, body)
            mine[status] = mine.get(status, 0) + 1
        rounds += 1
        if rounds == 1:
            counts.put("ready")
    counts.put(mine)


def dummy_api(port: int) -> None:
    """The control phase's target (a spawned process): the controller's API app with the same token and body
    limit over an empty view, no etcd and no NATS. The attackers' requests never pass validation, so each costs
    what it costs on the controller (guard, HTTP parsing, JSON, pydantic, the error's JSON) and nothing more."""
    import uvicorn

    from services.controller.api.app import create_app
    from services.controller.api.context import ApiContext
    from services.controller.api.server import ApiServer, bind
    from services.controller.metrics import ControllerMetrics
    from services.controller.settings import ControllerSettings
    from services.controller.view import ClusterView

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = ControllerSettings(instance="dummy", api_max_body_bytes=LIMIT)
    view = ClusterView()
    view.synced.set()
    ctx = ApiContext(settings=settings, view=view, store=None, bus=None,  # type: ignore[arg-type]
                     metrics=ControllerMetrics(view, lambda: False), is_leader=lambda: False, admin_token=TOKEN)
    sock = bind("127.0.0.1", port)
    config = uvicorn.Config(create_app(ctx), log_level="warning", access_log=False, lifespan="on")
    asyncio.run(ApiServer(config).serve(sockets=[sock]))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def _phase(sim: SimulatedCluster, engines: list[str], added: dict[str, asyncio.Future[float]],
                 children: list[procs.Child]) -> list[float]:
    """Each engine failed in turn; its latency is from the fault's publication to its successor's route."""
    from bench.controlplane import _check_alive

    loop = asyncio.get_running_loop()
    out = []
    for eid in engines:
        added[eid] = loop.create_future()
        t0 = time.time()
        await sim.fail(eid)
        try:
            out.append(await asyncio.wait_for(added[eid], 60) - t0)
        except TimeoutError:
            _check_alive(children)
            raise
        await asyncio.sleep(0.05)
    return sorted(out)


def _summary(lat: list[float]) -> dict[str, Any]:
    from bench.controlplane import _pct

    return {"n": len(lat), "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99), "max_ms": _pct(lat, 1.0)}


async def _under_load(port: int, loops: int, body_mb: int, near_limit: bool, measure: dict[str, int],
                      run: Callable[[], Awaitable[list[float]]]) -> dict[str, Any]:
    """`run()` while `loops` attackers hammer the API on `port` (each has made a first round before it starts);
    its latencies, the attackers' answers and rate, and the cores used by the processes in `measure`."""
    from bench.controlplane import _cpu_s

    ctx = mp.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Queue()
    attackers = [ctx.Process(target=attack, args=(port, body_mb, near_limit, stop, counts), daemon=True)
                 for _ in range(loops)]
    for p in attackers:
        p.start()
    try:
        for _ in attackers:  # every attacker has made a first round: the load is on
            assert await asyncio.to_thread(counts.get, True, 120) == "ready"
        pids = {**{name: [pid] for name, pid in measure.items()}, "attackers": [p.pid or 0 for p in attackers]}
        cpu0, t0 = {n: sum(_cpu_s(x) for x in ps) for n, ps in pids.items()}, time.monotonic()
        try:
            lat = await run()
        finally:
            stop.set()
        load_s = time.monotonic() - t0
        cores = {n: round((sum(_cpu_s(x) for x in ps) - cpu0[n]) / load_s, 3) for n, ps in pids.items()}
        answers: dict[str, int] = {}
        for _ in attackers:
            for k, v in (await asyncio.to_thread(counts.get, True, 60)).items():
                answers[k] = answers.get(k, 0) + v
    finally:
        stop.set()
        for p in attackers:
            p.join(10)
            if p.is_alive():
                p.kill()
    return {**_summary(lat), "attacker_answers": answers, "attacker_requests_per_s": round(sum(answers.values()) / load_s, 1),
            "cores": cores}


async def run_bench(incidents: int, loops: int, body_mb: int, workdir: Path, *, near_limit: bool = True) -> dict[str, Any]:
    from bench.controlplane import SimulatedCluster, _cpu_s, _service, _wait_health
    from libs.common import procs
    from libs.common.bus import Bus
    from libs.common.events import EndpointAdded, event_subject
    from libs.common.security.infra import SecureInfra
    from libs.common.store import Store

    nats_port, etcd_port, peer, api_port, dummy_port = (procs.free_port() for _ in range(5))
    sec = SecureInfra(workdir / "state" / "credentials", [], True)  # auth and TLS on, as the stack runs them
    settings = sec.settings(nats_url=f"nats://127.0.0.1:{nats_port}", etcd_endpoints=f"127.0.0.1:{etcd_port}",
                            state_dir=workdir / "state")
    infra = [procs.nats_server(nats_port, workdir / "nats", workdir / "nats.log",
                               config=sec.nats_config(workdir / "nats.conf", settings)).start(),
             procs.etcd_server(etcd_port, peer, workdir / "etcd", workdir / "etcd.log", tls_flags=sec.etcd_flags()).start()]
    children = list(infra)
    dummy = mp.get_context("spawn").Process(target=dummy_api, args=(dummy_port,), daemon=True)
    try:
        procs.wait_port(nats_port, infra[0])
        procs.wait_port(etcd_port, infra[1])
        sec.etcd_ready(etcd_port, settings)
        env = {**sec.env(), "HF_NATS_URL": settings.nats_url, "HF_ETCD_ENDPOINTS": settings.etcd_endpoints,
               "HF_STATE_DIR": str(settings.state_dir), "HF_LOG_LEVEL": "WARNING", "HF_INSTANCE": "c1",
               "HF_DATACENTER": "dc-1", "HF_API_PORT": str(api_port), "HF_ADMIN_TOKEN": TOKEN}
        bus = await Bus.connect(settings, "bench")
        store = await Store.connect(settings)
        sim = SimulatedCluster(bus, store, 1, 3 * incidents)
        await sim.populate()
        await sim.serve()
        controller = _service("services.controller", env, workdir / "controller.log")
        children += [controller, _service("services.dc_manager", env, workdir / "dc_manager.log")]
        dummy.start()
        await _wait_health(bus, "controller", "c1", children)
        await _wait_health(bus, "dc_manager", "dc-1", children)
        await asyncio.to_thread(procs.wait_port, dummy_port, None, 30.0)
        while await store.get("leader/controller") is None:  # noqa: ASYNC110 - polling etcd
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the leader's durable consumers are bound

        added: dict[str, asyncio.Future[float]] = {}

        async def on_added(msg: Any) -> None:
            pred = (json.loads(msg.data).get("data") or {}).get("predecessor_id")
            fut = added.get(pred) if isinstance(pred, str) else None
            if fut is not None and not fut.done():
                fut.set_result(time.time())

        await bus.nc.subscribe(event_subject(bus.prefix, EndpointAdded), cb=on_added)
        engines = list(sim.engines)
        batches = [engines[k * incidents:(k + 1) * incidents] for k in range(3)]

        def phase(k: int) -> Callable[[], Awaitable[list[float]]]:
            return lambda: _phase(sim, batches[k], added, children)

        rss0 = _rss_mib(controller.pid)
        cpu0, t0 = _cpu_s(controller.pid), time.monotonic()
        quiet = {**_summary(await phase(0)()),
                 "cores": {"controller": round((_cpu_s(controller.pid) - cpu0) / (time.monotonic() - t0), 3)}}
        measure = {"controller": controller.pid, "dummy": dummy.pid or 0}
        on_dummy = await _under_load(dummy_port, loops, body_mb, near_limit, measure, phase(1))
        rss_load = _rss_mib(controller.pid)
        on_controller = await _under_load(api_port, loops, body_mb, near_limit, measure, phase(2))
        rss1 = _rss_mib(controller.pid)
        await bus.close()
        await store.close()
        return {"incidents_per_phase": incidents, "attacker_loops": loops, "body_mb": body_mb, "near_limit": near_limit,
                "without_load": quiet, "load_on_dummy": on_dummy, "load_on_controller": on_controller,
                "controller_rss_mib": {"before": rss0, "after_dummy_phase": rss_load, "after": rss1},
                "cpus": os.cpu_count()}
    finally:
        if dummy.is_alive():
            dummy.kill()
            dummy.join(5)
        for c in reversed(children):
            c.stop()


PHASES = ("without_load", "load_on_dummy", "load_on_controller")


def cli(incidents: int = typer.Option(40, help="incidents per phase (one at a time)"),
        loops: int = typer.Option(3, help="attacker processes POSTing large bodies (second and third phases)"),
        body_mb: int = typer.Option(20, help="size of the attackers' large bodies (MB)"),
        near_limit: bool = typer.Option(True, help="attackers also send authenticated bodies just under the limit "
                                        "(read and parsed by the API)"),
        json_out: bool = typer.Option(False, "--json")) -> None:
    """Fault-to-resolved latency of the real pipeline: no load, API load on a dummy, on the controller."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the child processes are stopped
    with tempfile.TemporaryDirectory(prefix="hf-bench-apiload-") as d:
        from libs.common.service import run_loop

        result = run_loop(run_bench(incidents, loops, body_mb, Path(d), near_limit=near_limit))
    if json_out:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fault-to-resolved latency: no load, {loops} attacker loops on a dummy API process, "
                        "the same on the controller's API")
    for col in ("phase", "n", "p50 ms", "p99 ms", "max ms", "attacker req/s", "cores used"):
        table.add_column(col, justify="right")
    for phase in PHASES:
        s = result[phase]
        table.add_row(phase, str(s["n"]), str(s["p50_ms"]), str(s["p99_ms"]), str(s["max_ms"]),
                      str(s.get("attacker_requests_per_s", "")), " ".join(f"{k} {v}" for k, v in s["cores"].items()))
    Console().print(table)
    for phase in PHASES[1:]:
        Console().print(f"{phase}: attackers' answers {result[phase]['attacker_answers']}")
    Console().print(f"controller RSS MiB: {result['controller_rss_mib']}")


if __name__ == "__main__":
    typer.run(cli)
