"""`python -m engines.pattern`: a lightweight engine (no torch) for tests, benchmarks and chaos runs.

    active (default):   allocate --bytes of leased memory, fill the pattern, commit, serve, say ready
    HF_TAKEOVER_FROM:   cold-spawned successor: take the predecessor's leases over, serve, say ready
    standby:            connect (the warm-up), say ready, wait for an assignment, take over, say ready again

    --agent off:        no agent and no memory: serve, write --ready-file, wait for SIGTERM (the router tests)

It serves HTTP on 127.0.0.1 (an ephemeral port; the endpoint it reports, server.py): POST /generate (the router's
contract, deterministic tokens from tokens.py, no torch), GET /health, GET /checksum -> the sha256 of its leased
memory and whether it still holds the pattern; GET /healthz. With --bytes 0 it holds no memory (the detection
benchmark's engine); --no-http imports no HTTP stack at all. --fatal-after S reports a fatal CUDA error after
S seconds, then exits 1. --fatal-prompt TEXT plays a request that ends the engine (a "query of death"): a prompt
containing TEXT fails in-band with `engine_error` after its first token, and the process exits 70, as the batched
engine does when its step loop fails.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.pattern import pattern
from engines.ready_file import write_ready_file
from libs.common.ids import new_id

if TYPE_CHECKING:  # the HTTP stack is imported only where HTTP is served (--no-http starts without it)
    from engines.http_thread import HttpThread
    from engines.pattern.server import PatternState

log = logging.getLogger("holdfast.engine.pattern")


def parse(argv: list[str]) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(prog="python -m engines.pattern")
    p.add_argument("--bytes", type=int, default=int(env.get("HF_PATTERN_BYTES", "0")), help="leased bytes (0: none)")
    p.add_argument("--seed", type=int, default=int(env.get("HF_PATTERN_SEED", "7")))
    p.add_argument("--heartbeat-s", type=float, default=float(env.get("HF_PATTERN_HEARTBEAT_S", "0.1")))
    p.add_argument("--fatal-after", type=float, default=_float(env.get("HF_PATTERN_FATAL_AFTER_S")),
                   help="report a fatal cuda_error after this many seconds, then exit 1")
    p.add_argument("--exit-after", type=float, default=_float(env.get("HF_PATTERN_EXIT_AFTER_S")),
                   help="exit on its own after this many seconds")
    p.add_argument("--exit-code", type=int, default=int(env.get("HF_PATTERN_EXIT_CODE", "0")))
    p.add_argument("--fatal-prompt", default=env.get("HF_PATTERN_FATAL_PROMPT") or None,
                   help="a prompt containing this ends the engine: engine_error in-band, then exit 70")
    p.add_argument("--hang-prompt", default=env.get("HF_PATTERN_HANG_PROMPT") or None,
                   help="a prompt containing this blocks the HTTP server for good (heartbeats go on): a gray failure")
    p.add_argument("--crash-on-assign", action="store_true", default=bool(env.get("HF_PATTERN_CRASH_ON_ASSIGN")),
                   help="standby: die (exit 9) when assigned, as a standby that fails mid-takeover would")
    p.add_argument("--load-s", type=float, default=float(env.get("HF_PATTERN_LOAD_S", "0")),
                   help="seconds an active engine spends starting (registered, heartbeating) before ready: a load")
    p.add_argument("--warm-s", type=float, default=float(env.get("HF_PATTERN_WARM_S", "0")),
                   help="seconds a standby spends warming (registered, heartbeating) before it says ready: a CUDA "
                   "context and kernels")
    p.add_argument("--ballast-mib", type=int, default=int(env.get("HF_PATTERN_BALLAST_MIB", "0")),
                   help="host memory touched at start and held: a teardown as long as a big engine's (a killed "
                   "CUDA engine's pidfd turns readable ~145 ms after the signal; 256 MiB takes ~20 ms here)")
    p.add_argument("--no-http", action="store_true", default=bool(env.get("HF_PATTERN_NO_HTTP")))
    p.add_argument("--agent", choices=("on", "off"), default=env.get("HF_PATTERN_AGENT", "on"),
                   help="off: serve alone (no agent, no leased memory), as the router tests use it")
    p.add_argument("--id", default=env.get("HF_ENGINE_ID"), help="engine id with --agent off (default: a new one)")
    p.add_argument("--model", default="pattern", help="the model name /health reports (agent mode: HF_MODEL)")
    p.add_argument("--port", type=int, default=int(env.get("HF_PATTERN_PORT", "0")), help="HTTP port (0: a free one)")
    p.add_argument("--ready-file", type=Path, default=_path(env.get("HF_PATTERN_READY_FILE")),
                   help="written (JSON: endpoint, pid, engine_id) once serving")
    p.add_argument("--slots", type=int, default=int(env.get("HF_PATTERN_SLOTS", "4")),
                   help="generations served at once (the rest wait)")
    p.add_argument("--max-seq", type=int, default=int(env.get("HF_PATTERN_MAX_SEQ", "2048")),
                   help="the longest context; a longer prompt is refused (400), a generation stops there")
    p.add_argument("--token-interval-s", type=float, default=float(env.get("HF_PATTERN_TOKEN_INTERVAL_S", "0.002")),
                   help="time per generated token (the forward pass it stands for)")
    return p.parse_args(argv)


def _float(v: str | None) -> float | None:
    return float(v) if v else None


def _path(v: str | None) -> Path | None:
    return Path(v) if v else None


class Memory:
    """The engine's leased memory through the SDK (imported only when the engine holds memory)."""

    def __init__(self, engine_id: str, nbytes: int, engine_class: str) -> None:
        from libs.client.memory import MemoryClient, exit_on_lease_lost

        self.nbytes = nbytes
        self.client = MemoryClient.connect(engine_id, engine_class=engine_class)
        self.client.on_lease_lost = exit_on_lease_lost
        self.view: Any = None

    def allocate_or_reattach(self, seed: int) -> None:
        """Memory left by this engine id (a restart of the same engine) is reattached, else allocated."""
        if self.client.pending():
            self.view = self.client.attach().tensors("numpy")["pattern"]
            return
        # on the GPU the agent started it on (HF_GPU), where its leases and its GPU's faults belong
        lease = self.client.allocate(self.nbytes, tag="weights", name="pattern", gpu=int(os.environ.get("HF_GPU", "0")))
        self.view = lease.numpy("uint8", (self.nbytes,))
        pattern.fill(self.view, seed)
        self.client.register([lease.meta("pattern", "uint8", (self.nbytes,))])
        self.client.commit()

    def takeover(self, predecessor: str, token: str) -> None:
        self.view = self.client.takeover(predecessor, token).tensors("numpy")["pattern"]


def serve_http(state: PatternState, port: int) -> HttpThread:
    from engines.http_thread import HttpThread
    from engines.pattern.server import build_app

    # No warm-up request: Starlette does no first-request work worth moving (FastAPI's source reading is
    # what the reference engine's warm-up avoids).
    http = HttpThread(build_app(state), "127.0.0.1", port, warm=lambda _endpoint: None)
    http.start()
    return http


def serve_alone(args: argparse.Namespace, stop: threading.Event) -> int:
    """`--agent off`: no agent, no leased memory; serve, write the ready file, wait for SIGTERM or SIGINT."""
    from engines.pattern.server import PatternState

    engine_id = args.id or new_id("pattern")
    state = PatternState(engine_id, model=args.model, slots=args.slots, max_seq=args.max_seq,
                         token_interval_s=args.token_interval_s, seed=args.seed, fatal_prompt=args.fatal_prompt,
                         hang_prompt=args.hang_prompt)
    http = serve_http(state, args.port)
    state.state = "ready"
    if args.ready_file:
        write_ready_file(args.ready_file, {"endpoint": http.endpoint, "pid": os.getpid(), "engine_id": engine_id,
                                           "engine": "pattern"})
    log.info("engine %s serving at %s (no agent)", engine_id, http.endpoint)
    stop.wait()
    http.stop()
    return 0


def serve_with_agent(args: argparse.Namespace, stop: threading.Event) -> int:
    # Imported here: the link brings the event models (~0.15 CPU-s), which an engine with --agent off never uses.
    from libs.client.agent_link import AgentLink

    ballast = bytearray(args.ballast_mib << 20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # every page touched: resident until the exit
    link = AgentLink.connect()
    log.info("engine %s registered with the agent (%s)", link.engine_id, link.role)
    link.start_heartbeats(args.heartbeat_s)
    mem = Memory(link.engine_id, args.bytes, link.engine_class) if args.bytes > 0 else None
    state, endpoint = None, None
    if not args.no_http:
        from engines.pattern.server import PatternState

        state = PatternState(link.engine_id, model=os.environ.get("HF_MODEL", args.model), slots=args.slots,
                             max_seq=args.max_seq, token_interval_s=args.token_interval_s, seed=args.seed,
                             fatal_prompt=args.fatal_prompt, hang_prompt=args.hang_prompt, role=link.role, state="standby" if link.role == "standby" else "starting")
        endpoint = serve_http(state, args.port).endpoint

    if link.role == "standby":
        if args.warm_s > 0:
            time.sleep(args.warm_s)  # the warm-up it stands for
        link.ready(None)  # warm: SDK connected, code loaded; no weight memory held
        log.info("standby %s waiting for an assignment", link.engine_id)
        a = link.wait_assignment()
        log.info("assigned %s (incident %s)", a.predecessor, a.incident_id)
        if args.crash_on_assign:
            os._exit(9)
        if mem is not None:
            mem.takeover(a.predecessor, a.transfer_token)
    elif os.environ.get("HF_TAKEOVER_FROM"):
        if mem is not None:
            mem.takeover(os.environ["HF_TAKEOVER_FROM"], os.environ.get("HF_TRANSFER_TOKEN", ""))
    elif mem is not None:
        mem.allocate_or_reattach(args.seed)
    if link.role != "standby" and args.load_s > 0:
        time.sleep(args.load_s)  # the weight load it stands for
    if state is not None:
        state.view = None if mem is None else mem.view
        state.state = "ready"
    link.ready(endpoint)
    if args.ready_file and endpoint:
        write_ready_file(args.ready_file, {"endpoint": endpoint, "pid": os.getpid(), "engine_id": link.engine_id,
                                           "engine": "pattern"})
    log.info("engine %s serving at %s", link.engine_id, endpoint)

    started = time.monotonic()
    while not stop.is_set():
        elapsed = time.monotonic() - started
        if args.fatal_after is not None and elapsed >= args.fatal_after:
            link.report_fatal("cuda_error", "simulated: an illegal memory access was encountered")
            os._exit(1)  # what a CUDA-poisoned process does: no cleanup that could touch the device
        if args.exit_after is not None and elapsed >= args.exit_after:
            link.close()
            return args.exit_code
        stop.wait(0.02)
    link.close()
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("HF_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack in the engine's log
    args = parse(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return serve_alone(args, stop) if args.agent == "off" else serve_with_agent(args, stop)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
