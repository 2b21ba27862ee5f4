"""The engine process: memory (load, reattach or take over), model, HTTP server, agent link.

Start-up paths (DESIGN.md section 6):
- active, leases waiting for this engine id (pending): reattach them; no disk read.
- active, HF_TAKEOVER_FROM + HF_TRANSFER_TOKEN (a cold-spawned successor): take the predecessor's leases.
- active, nothing waiting: load the weights file into new leases (or plain tensors with --memory local).
- standby: warm the kernels on a scratch model of one layer, report ready as standby, wait for an
  assignment from the agent, take over the predecessor's leases, build the model over them, serve.
After a reattach or takeover the engine computes one token before it reports ready, and reports the
time from the assignment (or process start) to that first token (`recovery` in /health and the ready file).

The HTTP server starts first (on its own thread) and answers /health in every state, so the port is
known early and uvicorn's start-up is off the recovery path.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch

from engines.http_thread import HttpThread
from engines.ready_file import write_ready_file
from engines.reference.config import get_config
from engines.reference.engine import EngineCore, sample
from engines.reference.kv_reuse import retire_later
from engines.reference.memory import Loaded, scratch_weights
from engines.reference.model import Transformer
from engines.reference.server import EngineState, build_app, warm_routes
from engines.reference.settings import EngineSettings
from engines.reference.standby import Standby
from engines.reference.startup import first_token, open_agent_link, open_memory, pick_device
from libs.common.gc_tuning import long_lived_gc
from libs.common.procs import ms_since, reserve_fds, wall_time_of

log = logging.getLogger("holdfast.engine")
T_PROCESS = time.perf_counter()



def warm_standby(s: EngineSettings, device: torch.device) -> float:
    """Compile/load the kernels a forward pass uses, on a scratch one-layer model (no lease needed)."""
    cfg = get_config(s.size)
    t0 = time.perf_counter()
    w = scratch_weights(cfg, device)
    small = cfg.with_layers(1)
    kv = torch.zeros(small.kv_shape(1, 64), dtype=w["tok_embeddings.weight"].dtype, device=device)
    core = EngineCore(Transformer(small, w), kv, graphs=s.graphs)
    core.warm()
    sample(core.forward(0, [3], 3), 0.7, 1, 4)
    del core, kv, w
    return ms_since(t0)


def run(s: EngineSettings) -> int:
    reserve_fds()  # a takeover's burst of connections never waits for the kernel to grow the table (procs.py)
    if s.tp > 1:  # a tensor-parallel group: its own start-up (tp_runner.py)
        from engines.reference.tp_runner import run_tp

        return run_tp(s)
    logging.basicConfig(level=s.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(s.threads)
    cfg = get_config(s.size)
    max_seq = s.max_seq or cfg.max_seq
    device = pick_device(s.device)
    state = EngineState(s.id, s.model, s.size)
    state.role = s.role
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    link_box: list[Any] = []

    def report_and_die() -> None:
        try:
            if link_box:
                link_box[0].report_fatal("cuda_error", "injected: an illegal memory access was encountered")
        finally:
            os._exit(70)

    def injected_cuda_error(*_: Any) -> None:
        # Fault injection (chaos runs): behave as an engine whose CUDA context hit a fatal error does:
        # report it through the agent link, then exit without cleanup. Not from the handler itself: it runs
        # on the main thread, which may hold the link's send lock at that moment (a deadlock, seen as a hang).
        threading.Thread(target=report_and_die, name="fatal-report", daemon=True).start()

    signal.signal(signal.SIGUSR1, injected_cuda_error)

    http = HttpThread(build_app(state), s.host, s.port, warm_routes)
    http.start()
    memory = open_memory(s, device)
    link = open_agent_link(s, can_shadow=s.role == "standby" and s.shadow and memory.kind == "leased")
    if link is not None:
        link_box.append(link)
    state.info["memory"] = {"kind": memory.kind}
    try:
        t_start = T_PROCESS
        core: EngineCore | None = None
        loaded: Loaded | None = None
        if s.role == "standby":
            state.state = "standby"
            state.info["warmup_ms"] = warm_standby(s, device)
            if link is None:
                raise RuntimeError("standby mode needs an agent (HF_AGENT_SOCKET) to receive its assignment")
            link.ready(None)  # collects and freezes the warm heap (agent_link.ready: not on the takeover's path)
            log.info("standby %s warm (%.1f ms); waiting for an assignment", s.id, state.info["warmup_ms"])
            standby = Standby(s, cfg, memory, link, state, max_seq)
            a = standby.wait_assignment()
            t_start = time.perf_counter()
            state.role = "active"
            state.state = "loading"
            state.info["assignment"] = {"predecessor": a.predecessor, "incident_id": a.incident_id}
            if standby.shadows(a.predecessor):
                core = standby.promote(a.predecessor, a.transfer_token, t_start)
                loaded = None
            else:
                standby.drop()
                loaded = memory.takeover(cfg, a.predecessor, a.transfer_token, s.slots, max_seq)
        elif s.takeover_from:
            state.state = "loading"
            if not s.transfer_token:
                raise RuntimeError("HF_TAKEOVER_FROM needs HF_TRANSFER_TOKEN")
            loaded = memory.takeover(cfg, s.takeover_from, s.transfer_token, s.slots, max_seq)
        elif memory.pending():
            state.state = "loading"
            loaded = memory.attach(cfg, s.slots, max_seq)
        else:
            state.state = "loading"
            loaded = memory.load(cfg, s.weights, s.slots, max_seq)
        memory.start_heartbeats()
        if core is None:
            assert loaded is not None
            core = _build(s, cfg, loaded, state, t_start)
        state.install(core)
        long_lived_gc(collect=loaded is not None and loaded.source == "file")  # a recovery skips the full pass
        state.state = "ready"
        if link is not None:
            link.ready(http.endpoint, weights=loaded.weights_load if loaded is not None else None)
        if s.ready_file:
            write_ready_file(s.ready_file, {"endpoint": http.endpoint, "pid": os.getpid(), "engine_id": s.id,
                                            "state": "ready", **state.info})
        log.info("engine %s serving %s on %s (%s, %s)", s.id, s.model, http.endpoint,
                 loaded.source if loaded is not None else "shadow", device)
        stop.wait()
        state.state = "stopping"
        return 0
    finally:
        http.stop()
        if link is not None:
            link.close()
        memory.close()


def _build(s: EngineSettings, cfg: Any, loaded: Loaded, state: EngineState, t_start: float) -> EngineCore:
    t0 = time.perf_counter()
    recovered = loaded.source != "file"  # the KV lease was handed on: its slots wait for their requests
    core = EngineCore(Transformer(cfg, loaded.weights), loaded.kv, prefill_chunk=s.prefill_chunk, graphs=s.graphs,
                      marks=loaded.marks, inherit=recovered and s.kv_reuse_s > 0)
    build_ms = ms_since(t0)
    state.info["memory"] = {"kind": state.info["memory"]["kind"], "source": loaded.source,
                            "timings_ms": loaded.timings_ms, "build_ms": build_ms}
    if loaded.weights_load is not None:
        state.info["memory"]["weights"] = loaded.weights_load
    if loaded.source == "file":
        state.info["warmup_ms"] = core.warm()
        return core
    # Recovered memory: the generations the predecessor had in flight resume at once, in their own slots, and
    # the first token is computed before ready, from the weights as they are.
    if core.inherited is not None:
        core.continue_in_background(state.info.setdefault("continued", {}), early=False)
    first_token(core)
    if core.inherited is not None:
        retire_later(s.kv_reuse_s, core.retire_donor)  # the replayed requests come after ready
    rec: dict[str, Any] = {"source": loaded.source, "first_token_ms": ms_since(t_start), "t0_wall": wall_time_of(t_start),
                           "attach_ms": loaded.timings_ms.get("attach_ms"), "build_ms": build_ms}
    state.info["recovery"] = rec

    def first_request_token(at: float) -> None:
        rec["first_request_token_ms"] = round((at - t_start) * 1000, 3)
        core.capture_graphs_in_background()  # once it serves again: between the requests' forwards

    state.on_first_token = first_request_token
    core.trace_next(rec.setdefault("first_generation", {}), t_start)
    return core
