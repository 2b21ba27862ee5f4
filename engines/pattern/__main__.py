"""`python -m engines.pattern`: a lightweight engine (no torch) for tests, benchmarks and chaos runs.

    active (default):   allocate --bytes of leased memory, fill the pattern, commit, serve, say ready
    HF_TAKEOVER_FROM:   cold-spawned successor: take the predecessor's leases over, serve, say ready
    standby:            connect (the warm-up), say ready, wait for an assignment, take over, say ready again

It serves HTTP on 127.0.0.1 (an ephemeral port; the endpoint it reports): GET /checksum -> the sha256 of
its leased memory and whether it still holds the pattern; GET /healthz. With --bytes 0 it holds no memory
(the detection benchmark's engine). --fatal-after S reports a fatal CUDA error after S seconds, then exits 1.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engines.pattern import pattern
from libs.client.agent_link import AgentLink

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
    p.add_argument("--crash-on-assign", action="store_true", default=bool(env.get("HF_PATTERN_CRASH_ON_ASSIGN")),
                   help="standby: die (exit 9) when assigned, as a standby that fails mid-takeover would")
    p.add_argument("--no-http", action="store_true", default=bool(env.get("HF_PATTERN_NO_HTTP")))
    return p.parse_args(argv)


def _float(v: str | None) -> float | None:
    return float(v) if v else None


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


def serve_http(state: dict[str, Any]) -> str:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/checksum":
                view = state.get("view")
                body = {"engine_id": state["engine_id"], "bytes": 0 if view is None else int(view.size),
                        "sha256": None if view is None else pattern.checksum(view),
                        "pattern_ok": None if view is None else pattern.matches(view, state["seed"])}
            elif self.path == "/healthz":
                body = {"ok": True, "engine_id": state["engine_id"]}
            else:
                self.send_error(404)
                return
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def main(argv: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("HF_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack in the engine's log
    args = parse(argv)
    link = AgentLink.connect()
    log.info("engine %s registered with the agent (%s)", link.engine_id, link.role)
    link.start_heartbeats(args.heartbeat_s)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    state: dict[str, Any] = {"engine_id": link.engine_id, "seed": args.seed, "view": None}
    mem = Memory(link.engine_id, args.bytes, link.engine_class) if args.bytes > 0 else None
    endpoint = None if args.no_http else serve_http(state)

    if link.role == "standby":
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
    state["view"] = None if mem is None else mem.view
    link.ready(endpoint)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
