# ruff: noqa: E701, E702  (a measurement script, kept as it ran)
"""CPU per delivered message of a nats-py subscriber (and of nats-server), TLS+auth vs plain, stock asyncio vs uvloop.
A publisher process sends N messages of ~300 bytes in batches of 50 (each batch flushed); the subscriber counts them.
Usage: subcost.py <secure 0|1> <uvloop 0|1> [n]"""
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "/work/main")
from libs.common import procs
from libs.common.bus.connection import open_connection
from libs.common.security.infra import SecureInfra


def cpu(pid):
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

def run(secure, uv, n=40000):
    work = Path(tempfile.mkdtemp(prefix="subcost-"))
    port = procs.free_port()
    sec = SecureInfra(work / "cred", [], secure)
    settings = sec.settings(nats_url=f"nats://127.0.0.1:{port}", etcd_endpoints="127.0.0.1:1", state_dir=work)
    srv = procs.nats_server(port, work / "nats", work / "nats.log", config=sec.nats_config(work / "nats.conf", settings))
    if os.environ.get("STRACE"):
        srv.argv = ["strace", "-f", "-c", "-o", os.environ["STRACE"]] + srv.argv
    srv = srv.start()
    procs.wait_port(port, srv)
    # publisher in a child process so its CPU is apart
    pubcode = f"""
import asyncio, sys, json, time
sys.path.insert(0, '/work/main')
from pathlib import Path
from libs.common.security.infra import SecureInfra
from libs.common.bus.connection import open_connection
async def m():
    sec = SecureInfra(Path('{work}') / 'cred', [], {secure})
    s = sec.settings(nats_url='nats://127.0.0.1:{port}', etcd_endpoints='127.0.0.1:1', state_dir=Path('{work}'))
    nc = await open_connection(s, 'bench')
    body = json.dumps({{'type': 'fault.detected', 'data': {{'engine_id': 'n0001-g1-e0', 'pad': 'x' * 250}}}}).encode()
    sys.stdin.readline()
    for i in range(0, {n}, 50):
        for j in range(50):
            await nc.publish('t.x', body)
        await nc.flush()
    await nc.close()
asyncio.run(m())
"""
    pub = subprocess.Popen([sys.executable, "-c", pubcode], stdin=subprocess.PIPE)
    loop_factory = None
    if uv:
        import uvloop
        loop_factory = uvloop.new_event_loop
    async def sub_side():
        s = await open_connection(settings, "bench")
        got = [0]; done = asyncio.Event()
        async def cb(msg):
            got[0] += 1
            if got[0] == n: done.set()
        await s.subscribe("t.x", cb=cb)
        await s.flush()
        await asyncio.sleep(1.5)  # publisher connected
        c0, s0 = time.process_time(), cpu(srv.pid)
        pub.stdin.write(b"go\n"); pub.stdin.flush()
        await asyncio.wait_for(done.wait(), 120)
        c1, s1 = time.process_time(), cpu(srv.pid)
        await s.close()
        return (c1 - c0) / n * 1e6, (s1 - s0) / n * 1e6
    with asyncio.Runner(loop_factory=loop_factory) as r:
        client_us, server_us = r.run(sub_side())
    pub.wait()
    srv.stop()
    print(json.dumps({"secure": secure, "uvloop": uv, "n": n, "sub_client_us": round(client_us, 2), "nats_server_us": round(server_us, 2)}))

run(bool(int(sys.argv[1])), bool(int(sys.argv[2])), int(sys.argv[3]) if len(sys.argv) > 3 else 40000)
