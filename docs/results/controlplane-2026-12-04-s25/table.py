import re, statistics as st, sys, random
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\w)(\d+)-(base|head-plain|head-sec) .* inc/s=([\d.]+) cpu_ms=([\d.]+)", line)
    if m:
        rows.setdefault(int(m.group(2)), {})[m.group(3)] = (float(m.group(4)), float(m.group(5)))
def boot(xs, n=5000):
    random.seed(1); meds = sorted(st.median(random.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025*n)], meds[int(0.975*n)]
pb, sp, cpb, csp = [], [], [], []
print("| round | base | head plain | head secure | plain / base | secure / plain |\n| --- | --- | --- | --- | ---: | ---: |")
for r in sorted(rows):
    d = rows[r]
    if len(d) < 3: continue
    b, p, s = d["base"], d["head-plain"], d["head-sec"]
    pb.append(p[0]/b[0]); sp.append(s[0]/p[0]); cpb.append(p[1]/b[1]); csp.append(s[1]/p[1])
    print(f"| e{r} | {b[0]:,.0f}, {b[1]} | {p[0]:,.0f}, {p[1]} | {s[0]:,.0f}, {s[1]} | {pb[-1]:.2f} | {sp[-1]:.2f} |")
for name, xs in (("plain/base inc/s", pb), ("plain/base cpu", cpb), ("secure/plain inc/s", sp), ("secure/plain cpu", csp)):
    lo, hi = boot(xs)
    print(f"{name}: median {st.median(xs):.3f} (95% bootstrap of the median {lo:.2f}-{hi:.2f}); ahead/within: {sum(x>=1 for x in xs) if 'inc' in name else sum(x<=1 for x in xs)}/{len(xs)}")
