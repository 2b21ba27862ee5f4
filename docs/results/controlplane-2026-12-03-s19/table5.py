import json, statistics as st, sys, os
D = '/tmp/s19/out'; tag = sys.argv[1]; R = range(int(sys.argv[2]), int(sys.argv[3]) + 1)
kinds = sys.argv[4].split(',')
def L(n): return json.load(open(os.path.join(D, n + '.json')))
def load(n): return open(os.path.join(D, n + '.load')).read().strip().split('=')[1]
vals = {k: [] for k in kinds}
for r in R:
    cells = []
    for k in kinds:
        d = L(f'{tag}{r}-{k}'); vals[k].append(d)
        cells.append(f"{d['incidents_per_s']:,.0f}, {d['cpu_ms_per_incident']:.2f}")
    print(f"| {r} | " + " | ".join(cells) + " |")
def ratios(a, b, key):
    return [x[key] / y[key] for x, y in zip(vals[a], vals[b])]
for a, b in [p.split('/') for p in sys.argv[5].split(',')]:
    ri = ratios(a, b, 'incidents_per_s'); rc = ratios(a, b, 'cpu_ms_per_incident')
    print(f"{a}/{b} inc/s ratios", [round(x, 3) for x in ri], 'median', round(st.median(ri), 3), 'ahead', sum(x >= 1 for x in ri), 'of', len(ri))
    print(f"{a}/{b} cpu ratios", [round(x, 3) for x in rc], 'median', round(st.median(rc), 3))
for k in kinds:
    xs = vals[k]
    print(k, 'inc/s median', st.median(x['incidents_per_s'] for x in xs), 'cpu median', st.median(x['cpu_ms_per_incident'] for x in xs),
          {p.split()[0]: round(st.median(x['cpu_s'][p] for x in xs), 2) for p in xs[0]['cpu_s']},
          'txn', min(x['etcd_transactions'] for x in xs), max(x['etcd_transactions'] for x in xs),
          'p99', min(x['latency_ms']['p99'] for x in xs), max(x['latency_ms']['p99'] for x in xs),
          'resolved', min(x['resolved'] for x in xs))
