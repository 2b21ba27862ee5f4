# ruff: noqa: E701, E702  (a measurement script, kept as it ran)
"""Attach py-spy to the controller, dc_manager and bench processes run from <dir> as they appear; ends when they exit."""
import os
import subprocess
import sys
import time

d, label = sys.argv[1], sys.argv[2]
seen, spies = set(), []
deadline = time.time() + 400
while time.time() < deadline:
    for p in os.listdir("/proc"):
        if not p.isdigit() or p in seen:
            continue
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
            cwd = os.readlink(f"/proc/{p}/cwd")
        except OSError:
            continue
        if cwd != d or b"-m" not in cmd:
            continue
        mod = cmd[cmd.index(b"-m") + 1].decode()
        role = {"services.controller": "ctl", "services.dc_manager": "dcm", "holdfast.main": "bench"}.get(mod)
        if role:
            seen.add(p)
            spies.append(subprocess.Popen(["/work/main/.venv/bin/py-spy", "record", "--pid", p, "-r", "200", "-f", "raw",
                                           "-o", f"/tmp/s15/out/{label}-{role}.spy"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if len(seen) >= 3 and all(s.poll() is not None for s in spies):
        break
    time.sleep(0.1)
