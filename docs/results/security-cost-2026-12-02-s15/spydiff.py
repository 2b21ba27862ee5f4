# ruff: noqa: E701, E702  (a measurement script, kept as it ran)
import collections
import re
import sys


def load(f):
    incl = collections.Counter(); tot = 0
    for line in open(f):
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n); tot += n
        frames = set(re.sub(r":\d+\)", ")", fr) for fr in stack.split(";"))
        for fr in frames: incl[fr] += n
    return tot, incl
a, b = sys.argv[1], sys.argv[2]
ta, ia = load(a); tb, ib = load(b)
print(f"{a}: {ta} samples; {b}: {tb} samples; diff {ta-tb}")
keys = set(ia) | set(ib)
rows = sorted(keys, key=lambda k: -(ia[k] - ib[k]))
for k in rows[:int(sys.argv[3]) if len(sys.argv) > 3 else 30]:
    print(f"{ia[k]:6d} {ib[k]:6d} {ia[k]-ib[k]:+6d}  {k[:150]}")
