"""Tap: subscribe '>' on a nats server, tally count/bytes/header bytes per subject class. SIGUSR1 resets, SIGTERM dumps."""
import asyncio, json, re, signal, sys, collections
import nats

def cls(subject: str) -> str:
    parts = subject.split(".")
    out = []
    for p in parts:
        if re.search(r"\d", p) or len(p) > 20:
            out.append("*")
        else:
            out.append(p)
    return ".".join(out[:7])

async def main(url: str, outp: str) -> None:
    nc = await nats.connect(url, name="tap")
    tally: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    hdrkeys: collections.Counter = collections.Counter()
    samples: dict[str, str] = {}
    def reset(*_):
        tally.clear(); hdrkeys.clear(); samples.clear()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, reset)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async def cb(msg):
        c = cls(msg.subject)
        t = tally[c]
        t[0] += 1; t[1] += len(msg.data)
        if msg.headers:
            h = sum(len(k) + len(v) + 4 for k, v in msg.headers.items()) + 12
            t[2] += h
            for k in msg.headers: hdrkeys[(c, k)] += 1
        if c not in samples:
            samples[c] = repr(msg.headers) + " " + msg.data[:1500].decode(errors="replace")
    await nc.subscribe(">", cb=cb, pending_msgs_limit=10_000_000, pending_bytes_limit=-1)
    await stop.wait()
    await nc.flush()
    json.dump({"tally": {k: v for k, v in sorted(tally.items(), key=lambda kv: -kv[1][1])},
               "headers": {f"{c} {k}": n for (c, k), n in hdrkeys.items()}, "samples": samples}, open(outp, "w"), indent=1)
    await nc.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
