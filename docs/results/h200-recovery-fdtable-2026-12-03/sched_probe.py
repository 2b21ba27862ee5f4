"""Sample every engine process's threads from /proc (state, wchan, CPU run/wait ns) every ~1 ms; at the end
write, for each engine pid that went away, its and every other engine's thread transitions in a window around
its end (the kill): who ran, who waited in the kernel (and where), who waited on a futex (the GIL)."""
import json, os, signal, sys, time

stop = [False]
signal.signal(signal.SIGINT, lambda *_: stop.__setitem__(0, True))

out, seconds = sys.argv[1], float(sys.argv[2])
MATCH = b"engines.batched"

def rd(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)

pids, tasks, last, rec = {}, {}, {}, []
seen_last = {}
t_end = time.time() + seconds
t_scan = 0.0
while time.time() < t_end and not stop[0]:
    now = time.time()
    if now - t_scan > 0.02:
        t_scan = now
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) not in pids:
                cl = rd(f"/proc/{d}/cmdline")
                if cl and MATCH in cl and b"sched_probe" not in cl:
                    env = rd(f"/proc/{d}/environ") or b""
                    pids[int(d)] = {"cmd": cl.replace(b"\0", b" ").decode()[:300], "first": now}
        for pid in list(pids):
            try:
                tasks[pid] = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                tasks[pid] = []
    for pid, tids in tasks.items():
        if not tids:
            continue
        alive = False
        for tid in tids:
            st = rd(f"/proc/{pid}/task/{tid}/stat")
            if st is None:
                continue
            alive = True
            i = st.rfind(b")")
            comm = st[st.find(b"(") + 1:i].decode(errors="replace")
            state = st[i + 2:i + 3].decode()
            ss = rd(f"/proc/{pid}/task/{tid}/schedstat")
            run_ns, wait_ns = (int(x) for x in ss.split()[:2]) if ss else (0, 0)
            wchan = ""
            if state != "R":
                w = rd(f"/proc/{pid}/task/{tid}/wchan")
                wchan = w.decode(errors="replace") if w else ""
            key = (pid, tid)
            prev = last.get(key)
            if prev is None or prev[0] != state or prev[1] != wchan or run_ns - prev[2] > 1_000_000:
                last[key] = (state, wchan, run_ns)
                extra = ""
                if state == "D":
                    sc = rd(f"/proc/{pid}/task/{tid}/syscall") or b""
                    stk = rd(f"/proc/{pid}/task/{tid}/stack") or b""
                    extra = sc.decode(errors="replace").split(" ")[0] + " | " + stk.decode(errors="replace").replace("\n", " ; ")[:600]
                rec.append((round(now, 6), pid, tid, comm, state, wchan, run_ns, wait_ns, extra))
        if alive:
            seen_last[pid] = now
        else:
            tasks[pid] = []

ends = {pid: t for pid, t in seen_last.items() if not tasks.get(pid)}
windows = []
for pid, t in sorted(ends.items(), key=lambda kv: kv[1]):
    lo, hi = t - 0.4, t + 0.4
    windows.append({"pid": pid, "gone_at": t, "cmd": pids[pid]["cmd"],
                    "rows": [r for r in rec if lo <= r[0] <= hi]})
with open(out, "w") as f:
    json.dump({"pids": pids, "ends": ends, "windows": windows,
               "columns": ["t", "pid", "tid", "comm", "state", "wchan", "run_ns", "wait_ns", "syscall|stack"]}, f)
print(f"probe: {len(pids)} engine pids, {len(rec)} rows, {len(windows)} ends")
