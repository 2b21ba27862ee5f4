# ruff: noqa: E701, E702  (a measurement script, kept as it ran)
"""etcd CPU per request (and the client's), three ways: plain; TLS with client certificates but auth off; TLS and
auth on (RBAC, CN as user: what the stack runs). 4,000 puts then 4,000 gets of ~400 B, 50 in flight.
Usage: etcdcost.py plain|tls|tls+auth"""
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "/work/main")
from libs.common import procs
from libs.common.security.infra import SecureInfra
from libs.common.store import Store


def cpu(pid):
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

mode = sys.argv[1]; N = 4000
work = Path(tempfile.mkdtemp(prefix="etcdcost-"))
sec = SecureInfra(work / "cred", [], mode != "plain")
port, peer = procs.free_port(), procs.free_port()
settings = sec.settings(nats_url="nats://127.0.0.1:1", etcd_endpoints=f"127.0.0.1:{port}", state_dir=work)
srv = procs.etcd_server(port, peer, work / "etcd", work / "etcd.log", tls_flags=sec.etcd_flags()).start()
try:
    procs.wait_port(port, srv)
    if mode == "tls+auth":
        sec.etcd_ready(port, settings)
    async def main():
        st = await Store.connect(settings, source="controller")
        val = {"pad": "x" * 380}
        sem = asyncio.Semaphore(50)
        async def one(i, put):
            async with sem:
                if put: await st.put(f"bench/k{i}", val)
                else: await st.get(f"bench/k{i}")
        await asyncio.gather(*(one(i, True) for i in range(200)))
        out = {}
        for put in (True, False):
            c0, s0 = time.process_time(), cpu(srv.pid)
            await asyncio.gather(*(one(i, put) for i in range(N)))
            out["put" if put else "get"] = {"client_us": round((time.process_time() - c0) / N * 1e6, 1),
                                            "etcd_us": round((cpu(srv.pid) - s0) / N * 1e6, 1)}
        await st.close()
        return out
    print(json.dumps({"mode": mode, **asyncio.run(main())}))
finally:
    srv.stop()
