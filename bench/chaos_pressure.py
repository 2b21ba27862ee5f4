"""A hostile same-uid client of the gpu_manager, run by `holdfast chaos` as a process of its own (its fds are
its own, not the chaos run's): it opens many idle and half-open connections, sends garbage, and asks for
leases of many small chunks and one far larger than the machine, holds them for a while, then closes all.

What it prints (one JSON line) is what the manager answered: each request's outcome is `ok`, a typed error's
class name, or `dropped: ...` when the connection broke instead. `probe_during` / `probe_after` are a fresh
client's hello while the pressure holds and after it ended; a manager that still serves answers both (a
typed refusal during the pressure is an answer too).

    python -m bench.chaos_pressure --socket PATH --connections 200 --hold 60
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import resource
import select
import socket
import sys
import time
from typing import Any

from libs.client.memory import MemoryClient
from libs.common.errors import HoldfastError

CHUNK = 4096


def outcome(fn: Any, timeout_s: float) -> tuple[str, Any]:
    """('ok', result), (the typed error's name, None) or ('dropped: ...'/'timeout', None), within timeout_s."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return "ok", pool.submit(fn).result(timeout_s)
    except concurrent.futures.TimeoutError:
        return "timeout", None
    except HoldfastError as e:
        return type(e).__name__, None
    except Exception as e:  # noqa: BLE001 - a broken connection instead of an answer is the finding
        return f"dropped: {type(e).__name__}", None
    finally:
        pool.shutdown(wait=False)


def idle_connections(path: str, n: int, *, garbage_every: int = 4) -> list[socket.socket]:
    """n connections that never finish a frame: silent ones, and every `garbage_every`-th a partial header."""
    out: list[socket.socket] = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(2.0)
            s.connect(path)
            if i % garbage_every == 0:
                s.send(b"\xff\xff\x00")  # a length prefix never completed
        except OSError:
            s.close()
            break  # refused or out of fds: that is the pressure's ceiling
        out.append(s)
    return out


def probe(path: str, name: str) -> str:
    def hello() -> None:
        MemoryClient.connect(name, socket_path=path, reconnect_timeout_s=1.0).close()

    return outcome(hello, 10.0)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--chunk-mib", type=int, default=256, help="one lease of this many MiB in 4 KiB chunks")
    ap.add_argument("--huge-gib", type=int, default=1024, help="one lease of this many GiB (beyond the machine)")
    ap.add_argument("--hold", type=float, default=5.0, help="hold the pressure this long at most, s (a line on "
                    "stdin lets it go sooner)")
    args = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    name = f"chaos-pressure-{os.getpid()}"
    report: dict[str, Any] = {}
    conns = idle_connections(args.socket, args.connections)
    report["idle_connections"] = len(conns)
    client_state, client = outcome(lambda: MemoryClient.connect(name, socket_path=args.socket,
                                                                reconnect_timeout_s=1.0), 10.0)
    report["connect"] = client_state
    if client is not None:
        report["many_chunks"] = outcome(lambda: client.allocate(args.chunk_mib << 20, tag="other", name="chunks",
                                                                chunk_size=CHUNK), 30.0)[0]
        report["huge"] = outcome(lambda: client.allocate(args.huge_gib << 30, tag="other", name="huge"), 30.0)[0]
    report["probe_during"] = probe(args.socket, f"{name}-probe")
    print(json.dumps({"holding": True}), flush=True)  # the chaos run injects its engine fault now
    select.select([sys.stdin], [], [], args.hold)  # held until the run says its fault is over (a line), or --hold
    for s in conns:
        s.close()
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()
    time.sleep(0.5)
    report["probe_after"] = probe(args.socket, f"{name}-after")
    print(json.dumps(report), flush=True)
    os._exit(0)  # a thread still blocked in a hung call must not keep the process


if __name__ == "__main__":
    sys.exit(main())
