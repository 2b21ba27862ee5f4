import json, glob, re, statistics as st, sys
d = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cp15/res"
rows = {}
for f in sorted(glob.glob(f"{d}/r*-*.json")):
    m = re.match(r"r(\d+)-(\w+)\.json", f.split("/")[-1]); r, k = int(m[1]), m[2]
    j = json.load(open(f)); n = j["resolved"] or 1
    c = j["cpu_s"]
    rows.setdefault(r, {})[k] = {"inc/s": j["incidents_per_s"], "ms/inc": j["cpu_ms_per_incident"],
        "ctl": c["controller"]*1000/n, "dcm": c["dc_manager0"]*1000/n, "nats": c["nats"]*1000/n, "etcd": c["etcd"]*1000/n,
        "bench": c["bench (fault injection, simulated nodes)"]*1000/n, "txns": j["etcd_transactions"],
        "msgs/inc": (j["varz"]["in_msgs"]+j["varz"]["out_msgs"])/n, "KB/inc": (j["varz"]["in_bytes"]+j["varz"]["out_bytes"])/n/1000}
keys = ["inc/s","ms/inc","ctl","dcm","nats","etcd","bench","txns","msgs/inc","KB/inc"]
print("pair kind " + " ".join(f"{k:>8}" for k in keys))
for r in sorted(rows):
    for k in sorted(rows[r]):
        print(f"r{r:<3} {k:5}", " ".join(f"{rows[r][k][x]:8.2f}" for x in keys))
print("median ratio new/head over pairs with both:")
for x in keys:
    rat = [rows[r]["new"][x]/rows[r]["head"][x] for r in rows if "new" in rows[r] and "head" in rows[r]]
    if rat: print(f"  {x:8} {st.median(rat):.3f}  ({len(rat)} pairs: {' '.join(f'{v:.2f}' for v in rat)})")
