# ruff: noqa: E701, E702  (a measurement script, kept as it ran)
"""Per-thread CPU (utime, stime ticks, by thread name) of the controller, dc_manager, bench, nats-server, etcd run from <dir>: last values seen before each exits."""
import collections
import json
import os
import sys
import time

d, label = sys.argv[1], sys.argv[2]
last = {}
deadline = time.time() + 400; seen_any = False; quiet = 0
def role_of(p):
    cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
    if b"nats-server" in cmd[0] and any(b"hf-bench-cp" in c for c in cmd): return "nats"
    if cmd[0].endswith(b"etcd") and any(b"hf-bench-cp" in c for c in cmd): return "etcd"
    if os.readlink(f"/proc/{p}/cwd") != d or b"-m" not in cmd: return None
    return {"services.controller": "ctl", "services.dc_manager": "dcm", "holdfast.main": "bench"}.get(cmd[cmd.index(b"-m") + 1].decode())
roles = {}
while time.time() < deadline:
    for p in os.listdir("/proc"):
        if p.isdigit() and p not in roles:
            try: roles[p] = role_of(p)
            except OSError: roles[p] = None
    live = 0
    for p, r in roles.items():
        if not r: continue
        try:
            th = collections.defaultdict(lambda: [0, 0])
            for t in os.listdir(f"/proc/{p}/task"):
                s = open(f"/proc/{p}/task/{t}/stat").read()
                name = s[s.index("(") + 1:s.rindex(")")]
                f = s.rsplit(")", 1)[1].split()
                th[name][0] += int(f[11]); th[name][1] += int(f[12])
            last[f"{r}:{p}"] = dict(th); live += 1; seen_any = True
        except OSError:
            pass
    if seen_any and live == 0:
        quiet += 1
        if quiet > 20: break
    time.sleep(0.5)
json.dump(last, open(f"/tmp/s15/out/{label}-threads.json", "w"), indent=1)
