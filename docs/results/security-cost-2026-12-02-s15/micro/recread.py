# ruff: noqa: E701, E702  (a measurement script, kept as it ran)
"""Per-record cost of SSLObject.read as asyncio's SSLProtocol calls it (max_size 256 KiB), in memory."""
import ssl
import sys
import time
from pathlib import Path

d = Path(sys.argv[1])
sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); sctx.load_cert_chain(d / "server.pem", d / "server.key")
cctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
def pair():
    ci, co, si, so = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = cctx.wrap_bio(ci, co, server_hostname="localhost"); s = sctx.wrap_bio(si, so, server_side=True)
    for _ in range(10):
        for o, bio_out, peer_in in ((c, co, si), (s, so, ci)):
            try: o.do_handshake()
            except ssl.SSLWantReadError: pass
            peer_in.write(bio_out.read())
    return c, s, ci, so
c, s, ci, so = pair()
print(c.version(), c.cipher())
N = 20000
for size in (500, 4000):
    msg = b"x" * size
    for max_size in (256 * 1024, 16 * 1024):
        for _ in range(N): s.write(msg)
        ci.write(so.read())
        t = time.process_time(); n = 0
        try:
            while True:
                chunk = c.read(max_size)
                if not chunk: break
                n += 1
        except ssl.SSLWantReadError:
            pass
        dt = time.process_time() - t
        print(f"record {size} B, read({max_size}): {n} reads, {dt / n * 1e6:.2f} us each")
# encrypt side: per write call
for size in (500, 4000):
    msg = b"x" * size
    t = time.process_time()
    for _ in range(N): s.write(msg); so.read()
    print(f"write {size} B record: {(time.process_time() - t) / N * 1e6:.2f} us each")
