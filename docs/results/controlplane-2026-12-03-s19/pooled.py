"""Pooled ratios over the b (5-way), c and d (3-way) rounds (d9 on left out: another engineer's tests started, load 7-11): HEAD plain / a1bd35f, HEAD secure / HEAD plain, per round;
medians and a bootstrap 95% interval of the median (2,000 resamples)."""
import json, os, random, statistics as st, sys
D = sys.argv[1] if len(sys.argv) > 1 else '/tmp/s19/out'
def L(n): return json.load(open(os.path.join(D, n + '.json')))
pb, sp, cpb, csp = [], [], [], []
for tag, R, p, s in (('b', range(1, 9), 'h1-plain', 'h1-sec'), ('c', range(1, 21), 'head-plain', 'head-sec'),
                     ('d', range(1, 9), 'head-plain', 'head-sec')):
    for r in R:
        b, pl, se = L(f'{tag}{r}-base'), L(f'{tag}{r}-{p}'), L(f'{tag}{r}-{s}')
        pb.append(pl['incidents_per_s'] / b['incidents_per_s']); sp.append(se['incidents_per_s'] / pl['incidents_per_s'])
        cpb.append(pl['cpu_ms_per_incident'] / b['cpu_ms_per_incident']); csp.append(se['cpu_ms_per_incident'] / pl['cpu_ms_per_incident'])
random.seed(1)
def boot(xs):
    ms = sorted(st.median(random.choices(xs, k=len(xs))) for _ in range(2000))
    return round(ms[50], 3), round(ms[1950], 3)
print('rounds', len(pb))
print('plain/base incidents/s median', round(st.median(pb), 3), boot(pb), 'ahead', sum(x >= 1 for x in pb))
print('plain/base CPU an incident median', round(st.median(cpb), 3), boot(cpb))
print('secure/plain incidents/s median', round(st.median(sp), 3), boot(sp), 'within 5%', sum(x >= 0.95 for x in sp))
print('secure/plain CPU an incident median', round(st.median(csp), 3), boot(csp))
