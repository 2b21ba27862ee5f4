"""`holdfast bench attach --backend host|cuda --gib N --chunk-mib M [--json]`: how long an engine takes to get
a lease back (receive fds, import, map the whole lease) in a fresh process and in a warm one.

A throwaway stack (nats-server, etcd, a gpu_manager on the chosen backend) runs in a temp dir. An allocator
process leases N GiB in M MiB chunks, stamps each chunk's first bytes, commits, and exits (its lease turns
ORPHANED). Then:
- fresh: a new process imports the SDK, connects and attaches; we report the import, the CUDA init (cuda
  only) and the attach separately (milliseconds);
- warm: a process that already imported, connected and set up CUDA is told to attach (the warm-standby
  path), then unmaps and attaches again a few times (median reported).
After each attach the stamps are checked outside the timed region. `ms_per_chunk` = warm attach / chunks.
Goal on an H200: <= 10 ms for 140 GiB at 1 GiB chunks.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

from libs.common import procs
from libs.common.security.infra import SecureInfra

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "bench-attach"
REPEATS = 5


# ---------------------------------------------------------------- worker side (runs in the engine processes)


def _stamp_view(lease: Any, offset: int) -> Any:
    if lease.mapping.kind == "host":
        return lease.numpy("int64", (1,), offset)
    return lease.torch("int64", (1,), offset)


def _check_stamps(leases: list[Any]) -> bool:
    for lease in leases:
        for i in range(len(range(0, lease.info.size, lease.info.chunk_size))):
            if int(_stamp_view(lease, i * lease.info.chunk_size)[0]) != 1000 + i:
                return False
    return True


def worker(mode: str, socket_path: str, nbytes: int) -> None:
    t0 = time.perf_counter()
    from libs.client.memory import MemoryClient

    t_import = time.perf_counter() - t0
    client = MemoryClient.connect(ENGINE, socket_path=socket_path)
    out: dict[str, Any] = {"import_ms": t_import * 1e3}
    if mode == "alloc":
        lease = client.allocate(nbytes, name="bench")
        for i in range(len(range(0, lease.info.size, lease.info.chunk_size))):
            _stamp_view(lease, i * lease.info.chunk_size)[0] = 1000 + i
        if client.backend == "cuda":
            import torch

            torch.cuda.synchronize()
        client.register([lease.meta("stamp", "int64", (1,))])
        client.commit()
        print(json.dumps({"chunks": len(range(0, lease.info.size, lease.info.chunk_size)), "size": lease.info.size}),
              flush=True)
        os._exit(0)  # exit without unmapping: the lease is orphaned, as after a crash
    if client.backend == "cuda":
        t1 = time.perf_counter()
        from libs.client import cuda_driver as cd

        cd.init()
        cd.primary_context(0)
        out["cuda_init_ms"] = (time.perf_counter() - t1) * 1e3
    if mode == "warm":
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
    t2 = time.perf_counter()
    att = client.attach()
    out["attach_ms"] = (time.perf_counter() - t2) * 1e3
    out["ok"] = _check_stamps(att.leases)
    if mode == "warm":
        again = []
        for _ in range(REPEATS):
            for lease in att.leases:
                lease.unmap()
            client.leases.clear()
            t3 = time.perf_counter()
            att = client.attach()
            again.append((time.perf_counter() - t3) * 1e3)
            out["ok"] = out["ok"] and _check_stamps(att.leases)
        out["reattach_ms_median"] = statistics.median(again)
    print(json.dumps(out), flush=True)
    os._exit(0)


# ---------------------------------------------------------------- driver side


def _spawn(mode: str, socket_path: str, nbytes: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "bench.attach", mode, socket_path, str(nbytes)], cwd=ROOT,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"bench worker exited with {proc.wait()}")
    return json.loads(line)


def run(backend: str, gib: float, chunk_mib: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="hf-bench-attach-"))
    nats_port, etcd_port, peer = procs.free_port(), procs.free_port(), procs.free_port()
    state = tmp / "state"
    sec = SecureInfra(state / "credentials", ["node-1"])  # auth and TLS, as the stack runs them
    settings = sec.settings(state_dir=state)
    nats = procs.nats_server(nats_port, tmp / "nats", tmp / "nats.log", config=sec.nats_config(tmp / "nats.conf", settings)).start()
    etcd = procs.etcd_server(etcd_port, peer, tmp / "etcd", tmp / "etcd.log", tls_flags=sec.etcd_flags()).start()
    env = {**os.environ, **sec.env(), "HF_NODE": "node-1", "HF_NATS_URL": f"nats://127.0.0.1:{nats_port}", "HF_ETCD_ENDPOINTS": f"127.0.0.1:{etcd_port}",
           "HF_STATE_DIR": str(state), "HF_BACKEND": backend, "HF_CHUNK_MIB": str(chunk_mib), "HF_GRACE_S": "3600"}
    socket_path = str(state / "gpu_manager.sock")
    manager = procs.Child("gpu_manager", [sys.executable, "-m", "services.gpu_manager"], env=env,
                          log_path=tmp / "gpu_manager.log")
    try:
        procs.wait_port(nats_port, nats)
        procs.wait_port(etcd_port, etcd)
        sec.etcd_ready(etcd_port, settings)
        manager.start()
        deadline = time.monotonic() + 60
        while not Path(socket_path).exists():
            if not manager.alive() or time.monotonic() > deadline:
                raise RuntimeError((tmp / "gpu_manager.log").read_text()[-2000:])
            time.sleep(0.05)
        nbytes = int(gib * (1 << 30))
        alloc = _spawn("alloc", socket_path, nbytes, env)
        made = _line(alloc)
        alloc.wait()
        fresh = _spawn("fresh", socket_path, nbytes, env)
        fresh_out = _line(fresh)
        fresh.wait()
        warm = _spawn("warm", socket_path, nbytes, env)
        _line(warm)  # ready: imported, connected, CUDA context up
        assert warm.stdin is not None
        warm.stdin.write("go\n")
        warm.stdin.flush()
        warm_out = _line(warm)
        warm.wait()
        return {
            "backend": backend, "gib": gib, "chunk_mib": chunk_mib, "chunks": made["chunks"], "bytes": made["size"],
            "fresh": fresh_out, "warm": warm_out,
            "ms_per_chunk": warm_out["attach_ms"] / made["chunks"],
            "verified": bool(fresh_out["ok"] and warm_out["ok"]),
        }
    finally:
        manager.stop()
        keeper_pid = state / "gpu_keeper.sock.pid"
        if keeper_pid.exists():
            try:
                os.kill(int(keeper_pid.read_text()), 15)
            except (ProcessLookupError, ValueError):
                pass
        etcd.stop()
        nats.stop()


def cli(backend: str = "host", gib: float = 1.0, chunk_mib: int = 1024,
        json_out: bool = typer.Option(False, "--json")) -> None:
    """Time import+map of a whole lease in a fresh and in a warm process."""
    result = run(backend, gib, chunk_mib)
    if json_out:
        print(json.dumps(result, indent=2))
        return
    f, w = result["fresh"], result["warm"]
    print(f"attach {result['gib']} GiB on {result['backend']} in {result['chunks']} chunks of {chunk_mib} MiB "
          f"(verified: {result['verified']})")
    print(f"  fresh process: import {f['import_ms']:.1f} ms, cuda init {f.get('cuda_init_ms', 0):.1f} ms, "
          f"attach {f['attach_ms']:.2f} ms")
    print(f"  warm process:  attach {w['attach_ms']:.2f} ms ({result['ms_per_chunk']:.3f} ms/chunk), "
          f"re-attach median {w['reattach_ms_median']:.2f} ms")


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
