"""RTT of a NATS request/reply through our Bus client, TLS+nkeys vs plain, same machine."""
import asyncio, sys, time, statistics as st, tempfile
from pathlib import Path
from libs.common import procs
from libs.common.bus import Bus
from libs.common.security.infra import SecureInfra

async def one(secure: bool, n: int) -> list[float]:
    wd = Path(tempfile.mkdtemp(prefix="hf-lat-"))
    port = procs.free_port()
    sec = SecureInfra(wd / "state" / "credentials", [], secure)
    settings = sec.settings(nats_url=f"nats://127.0.0.1:{port}", etcd_endpoints="127.0.0.1:1", state_dir=wd / "state")
    srv = procs.nats_server(port, wd / "nats", wd / "nats.log", config=sec.nats_config(wd / "nats.conf", settings)).start()
    try:
        procs.wait_port(port, srv)
        a = await Bus.connect(settings, "a", stream=False)
        b = await Bus.connect(settings, "b", stream=False)
        subj = f"{a.prefix}.lat"
        async def echo(msg):
            await b.nc.publish(msg.reply, msg.data)
        await b.nc.subscribe(subj, cb=echo)
        await b.nc.flush()
        out = []
        for i in range(n):
            t = time.perf_counter()
            await a.nc.request(subj, b"x" * 300, timeout=5)
            out.append((time.perf_counter() - t) * 1e6)
        await a.close(); await b.close()
        return out
    finally:
        srv.stop()

async def main():
    n = int(sys.argv[1])
    for r in range(3):
        for secure in (True, False) if r % 2 == 0 else (False, True):
            xs = sorted(await one(secure, n))
            print(f"{'secure' if secure else 'plain '} p50 {st.median(xs):7.1f} us  p90 {xs[int(.9*len(xs))]:7.1f}  min {xs[0]:6.1f}", flush=True)
asyncio.run(main())
