"""RTT of a JetStream acked publish and of an etcd put, secure (TLS+auth) vs plain, through our clients."""
import asyncio, sys, time, statistics as st, tempfile
from pathlib import Path
from libs.common import procs
from libs.common.bus import Bus
from libs.common.store import Store
from libs.common.security.infra import SecureInfra

async def one(secure: bool, n: int):
    wd = Path(tempfile.mkdtemp(prefix="hf-lat-"))
    port, eport, peer = procs.free_port(), procs.free_port(), procs.free_port()
    sec = SecureInfra(wd / "state" / "credentials", [], secure)
    settings = sec.settings(nats_url=f"nats://127.0.0.1:{port}", etcd_endpoints=f"127.0.0.1:{eport}", state_dir=wd / "state")
    kids = [procs.nats_server(port, wd / "nats", wd / "nats.log", config=sec.nats_config(wd / "nats.conf", settings)).start(),
            procs.etcd_server(eport, peer, wd / "etcd", wd / "etcd.log", tls_flags=sec.etcd_flags()).start()]
    try:
        procs.wait_port(port, kids[0]); procs.wait_port(eport, kids[1]); sec.etcd_ready(eport, settings)
        a = await Bus.connect(settings, "a")
        s = await Store.connect(settings)
        subj = f"{a.prefix}.events.lat"
        js, et = [], []
        for i in range(n):
            t = time.perf_counter(); await a.js.publish(f"{settings.stream_subjects_prefix if hasattr(settings,'stream_subjects_prefix') else a.prefix}.fault.detected.x", b"x" * 300); js.append((time.perf_counter() - t) * 1e6)
            t = time.perf_counter(); await s.put(f"incidents/lat{i % 50}", {"i": i}); et.append((time.perf_counter() - t) * 1e6)
        await a.close(); await s.close()
        return sorted(js), sorted(et)
    finally:
        for k in kids: k.stop()

async def main():
    n = int(sys.argv[1])
    for r in range(2):
        for secure in (True, False) if r % 2 == 0 else (False, True):
            js, et = await one(secure, n)
            print(f"{'secure' if secure else 'plain '} js p50 {st.median(js):7.1f} us p90 {js[int(.9*len(js))]:7.1f} | etcd put p50 {st.median(et):7.1f} us p90 {et[int(.9*len(et))]:7.1f}", flush=True)
asyncio.run(main())
