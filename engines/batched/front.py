"""The batched engine's HTTP front: a process of its own, started by the engine (front_link.py `FrontLink`, which
says why), serving server.py's API on the socket the engine bound, the engine behind the link.

    python -m engines.batched.front --listen-fd N --link-fd M --parent-pid P [--engine-id ...]

It runs uvicorn on its main thread; once it listens, its routes' first-use costs are paid (server.py
`warm_routes`) and it says `Hello` over the link: the engine reports itself ready to nobody before that. It exits
the moment the link ends, and dies with the engine's main thread (PR_SET_PDEATHSIG): front_link.py invariant 2.

Its port is trusted (docs/security.md), but a client still meets limits, those of every Holdfast HTTP API
(libs/common/web): a body over `--max-body-bytes` is refused (413) from its headers, or as it is counted when
chunked; a request's headers must be complete within `--header-timeout-s` of its first byte (or the connection
closes) and its body within `--body-timeout-s` of its headers (408); bytes that are not HTTP get a 400. Each
answer is the API's typed JSON error, and a refused client that keeps sending reads it (lingering close). The
engine passes the three from its config (config.py: `--max-body-bytes` or `HF_ENGINE_MAX_BODY_BYTES`, ...).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import logging
import os
import signal
import socket
import threading
import time

import uvicorn

from engines.batched.front_link import EngineLink
from engines.batched.http_state import EngineState
from engines.batched.server import build_app, front_door, refusal, warm_routes
from libs.common import procs
from libs.common.web.linger import LingerStats, lingering_httptools

PR_SET_PDEATHSIG = 1
# A `/generate_many` of every stream of a dead engine (256 of 4k-token contexts and their resumed tokens) is a few
# MB; the link takes a frame of 64 MiB at most.
LINGER_MAX_BYTES = 64 << 20  # after a refusal, what a client still sends is dropped up to this much...
LINGER_MAX_S = 5.0  # ...and for at most this long (libs/common/web/linger.py)
log = logging.getLogger("holdfast.engine.batched.front")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engines.batched.front", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen-fd", type=int, required=True, help="the listening socket the engine bound")
    p.add_argument("--link-fd", type=int, required=True, help="the front's end of the link")
    p.add_argument("--parent-pid", type=int, required=True, help="the engine's pid (the front dies with it)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--engine-id", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--size", required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-waiting", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--hold-s", type=float, default=0.0)
    p.add_argument("--loop-watch-s", type=float, default=0.0)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--max-body-bytes", type=int, required=True, help="a request body over this is refused (413)")
    p.add_argument("--header-timeout-s", type=float, required=True,
                   help="a request's headers must be complete this long after its first byte (0: no bound)")
    p.add_argument("--body-timeout-s", type=float, required=True,
                   help="a request's body must be complete this long after its headers, or 408 (0: no bound)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent_pid:  # the engine died before the line above: nothing to serve
        os._exit(0)
    procs.reserve_fds()  # the burst of resumed streams' connections after a takeover never waits to grow the table
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # as the engine's (engines/batched/__main__.py)
    state = EngineState(args.engine_id, args.model, args.size, args.max_model_len, args.max_waiting)
    state.hold_s, state.loop_watch_s = args.hold_s, args.loop_watch_s
    link = EngineLink(socket.socket(fileno=args.link_fd), args.max_num_seqs, state.apply_status)
    state.link = link
    app = build_app(state)
    app.router.on_startup.append(link.start)
    listener = socket.socket(fileno=args.listen_fd)
    port = listener.getsockname()[1]
    linger = LingerStats()
    protocol = lingering_httptools(LINGER_MAX_BYTES, LINGER_MAX_S, linger, args.header_timeout_s, args.body_timeout_s,
                                   refusal)
    server = uvicorn.Server(uvicorn.Config(front_door(app, state, args.max_body_bytes, linger), log_level="warning",
                                           access_log=False, timeout_keep_alive=30, http=protocol))

    def warm() -> None:
        while not server.started:
            time.sleep(0.005)
        warm_routes(f"http://{args.host}:{port}")
        loop = link.loop
        if loop is not None:
            loop.call_soon_threadsafe(link.hello)

    threading.Thread(target=warm, name="front-warm", daemon=True).start()
    server.run(sockets=[listener])
    os._exit(0)  # asked to stop (a signal): the link's end tells the engine


if __name__ == "__main__":
    main()
