"""Run the controlplane bench from the cwd's tree with nats monitoring; snapshot /varz,/connz at the CPU marks.
measure.py LABEL [--tap] [--spy] [bench args...]"""
import json, os, signal, subprocess, sys, time, urllib.request
sys.path.insert(0, os.getcwd())
label = sys.argv[1]
args = sys.argv[2:]
tap = "--tap" in args; spy = "--spy" in args; cprof = "--cprof" in args
args = [a for a in args if a not in ("--tap", "--spy", "--cprof")]
OUT = "/tmp/s19/out"
from libs.common import procs
import bench.controlplane as cp
mport = procs.free_port()
orig_nats = procs.nats_server
state = {"names": {}, "snaps": [], "tap": None, "spies": [], "nats_port": None}
def nats_server(port, *a, **k):
    c = orig_nats(port, *a, **k)
    if state["nats_port"] is None:
        c.argv += ["-m", str(mport)]
        state["nats_port"] = port
    return c
procs.nats_server = nats_server
orig_etcd = procs.etcd_server
def etcd_server(port, *a, **k):
    state["etcd_port"] = port
    return orig_etcd(port, *a, **k)
procs.etcd_server = etcd_server
def etcd_metrics():
    import re
    try:
        txt = urllib.request.urlopen(f"http://127.0.0.1:{state['etcd_port']}/metrics").read().decode()
    except Exception as e:
        return {"error": str(e)}
    out = {}
    for line in txt.splitlines():
        m = re.match(r'grpc_server_(handled|msg_received|msg_sent)_total\{(.*)\} (\S+)', line)
        if m:
            lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = f"{m.group(1)}:{lab.get('grpc_method')}" + (f":{lab.get('grpc_code')}" if m.group(1) == 'handled' else '')
            out[key] = out.get(key, 0) + float(m.group(3))
    return out
orig_start = procs.Child.start
def start(self):
    r = orig_start(self)
    state["names"][self.name] = self.pid
    if self.name == "nats" and tap:
        procs.wait_port(state["nats_port"], self)
        state["tap"] = subprocess.Popen([sys.executable, "/tmp/s19/tap.py", f"nats://127.0.0.1:{state['nats_port']}", f"{OUT}/{label}-tap.json"])
        time.sleep(1.0)
    return r
procs.Child.start = start
def get(path):
    return json.load(urllib.request.urlopen(f"http://127.0.0.1:{mport}/{path}"))
orig_cpu = cp._cpu_s
def cpu_s(pid):
    if pid == state["names"].get("nats"):
        v = get("varz"); c = get("connz?limit=1000")
        state["snaps"].append((v, c))
        state.setdefault("etcd", []).append(etcd_metrics())
        io = {}
        for n, p in list(state["names"].items()) + [("bench", os.getpid())]:
            try:
                d = dict(l.split(": ") for l in open(f"/proc/{p}/io").read().splitlines())
                io[n] = {k: int(d[k]) for k in ("syscr", "syscw")}
                th = {}
                for t in os.listdir(f"/proc/{p}/task"):
                    f = open(f"/proc/{p}/task/{t}/stat").read().rsplit(")", 1)
                    comm = open(f"/proc/{p}/task/{t}/comm").read().strip()
                    fl = f[1].split()
                    th[f"{comm}:{t}"] = int(fl[11]) + int(fl[12])
                io[n]["threads"] = th
                pf = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
                io[n]["utime"], io[n]["stime"] = int(pf[11]), int(pf[12])
            except Exception as e:
                io[n] = {"error": str(e)}
        state.setdefault("io", []).append(io)
        if len(state["snaps"]) == 1:
            if cprof: PROF.enable()
            if state["tap"]:
                state["tap"].send_signal(signal.SIGUSR1)
            if "HF_STRACE" in os.environ:
                state["straces"] = [subprocess.Popen(["strace", *(["-e", "trace=write,writev", "-e", "signal=none", "-s", "0"] if os.environ.get("HF_STRACE") == "w" else ["-c"]), "-f", "-o", f"{OUT}/{label}-{n.split('.')[-1]}.strace", "-p", str(state["names"][n])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n in (("nats",) if os.environ.get("HF_STRACE") == "w" else ("services.controller", "services.dc_manager", "nats"))]
            if "HF_PERF" in os.environ:
                state["perf"] = subprocess.Popen(["perf", "record", "-F", "4999", "-g", "-o", f"{OUT}/{label}-nats.perf", "-p", str(state["names"]["nats"])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if spy:
                for n in ("services.controller", "services.dc_manager"):
                    state["spies"].append(subprocess.Popen(["/tmp/pyspy/bin/py-spy", "record", "--nonblocking", "-r", "250", "-f", "raw", "-o", f"{OUT}/{label}-{n.split('.')[1]}.txt", "--pid", str(state["names"][n])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                state["spies"].append(subprocess.Popen(["/tmp/pyspy/bin/py-spy", "record", "--nonblocking", "-r", "250", "-f", "raw", "-o", f"{OUT}/{label}-bench.txt", "--pid", str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        else:
            if cprof:
                PROF.disable(); PROF.dump_stats(f"{OUT}/{label}-bench.prof")
            for st in state.get("straces", []):
                st.send_signal(signal.SIGINT); st.wait()
            if state.get("perf"):
                state["perf"].send_signal(signal.SIGINT); state["perf"].wait()
            for s in state["spies"]:
                s.send_signal(signal.SIGINT)
            for s in state["spies"]:
                s.wait()
            if state["tap"]:
                time.sleep(0.5)
                state["tap"].send_signal(signal.SIGTERM); state["tap"].wait()
    return orig_cpu(pid)
cp._cpu_s = cpu_s
import cProfile
PROF = cProfile.Profile()
orig_service = cp._service
def service(module, env, log_path):
    if not cprof:
        return orig_service(module, env, log_path)
    out = f"{OUT}/{label}-{module.split('.')[1]}.prof"
    return procs.Child(module, [sys.executable, "-m", "cProfile", "-o", out, "-m", module], env=env, log_path=log_path).start()
cp._service = service
import asyncio
from libs.common.service import run_loop
import tempfile
from pathlib import Path
secure = "--no-secure" not in args
kw = {"secure": secure} if "secure" in cp.run_bench.__code__.co_varnames else {}
with tempfile.TemporaryDirectory(prefix="hf-cp15-") as d:
    res = run_loop(cp.run_bench(1000, 8, 8000, Path(d), **kw))
(v0, c0), (v1, c1) = state["snaps"][0], state["snaps"][-1]
varz = {k: v1[k] - v0[k] for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}
conns0 = {c["cid"]: c for c in c0["connections"]}
conns = {}
for c in c1["connections"]:
    b = conns0.get(c["cid"], {})
    name = c.get("name") or str(c["cid"])
    conns[f"{name}#{c['cid']}"] = {k: c[k] - b.get(k, 0) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}
res["varz"] = varz; res["connz"] = conns
e0, e1 = state["etcd"][0], state["etcd"][-1]
i0, i1 = state["io"][0], state["io"][-1]
res["io"] = {}
for n in i1:
    if "syscr" in i1[n] and "syscr" in i0.get(n, {}):
        res["io"][n] = {k: i1[n][k] - i0[n][k] for k in ("syscr", "syscw", "utime", "stime")}
        res["io"][n]["threads"] = {t: v - i0[n]["threads"].get(t, 0) for t, v in i1[n]["threads"].items() if v - i0[n]["threads"].get(t, 0)}
        print("   io", n, res["io"][n])
res["etcd_grpc"] = {k: e1[k] - e0.get(k, 0) for k in e1 if k != "error" and e1[k] - e0.get(k, 0)}
for k, v in sorted(res["etcd_grpc"].items()):
    print("   etcd", k, v)
json.dump(res, open(f"{OUT}/{label}.json", "w"), indent=1)
print(label, "inc/s", res["incidents_per_s"], "cpu", res["cpu_s"], "ms/inc", res["cpu_ms_per_incident"])
print("varz", varz, {k: round(v / 8000, 1) for k, v in varz.items()})
for k, v in conns.items():
    print("  ", k, v)
