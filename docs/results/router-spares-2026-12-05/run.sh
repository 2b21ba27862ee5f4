#!/usr/bin/env bash
# local router A/B: $1 label
cd /work/main
timeout 400 .venv/bin/python -m holdfast.main bench recovery --backend host --streams 32 --late 8 --trials 3 --max-tokens 48 --secure --json > /tmp/lr-$1.json 2>/tmp/lr-$1.err
python3 - "$1" <<'PY'
import json, sys
d = json.load(open(f"/tmp/lr-{sys.argv[1]}.json")); s = d["sigkill"]
rl = s["router_loop_late"]
print(sys.argv[1], "gap", s["largest_gap_ms"], "late", s["late_first_token_ms"]["p99"], "spare", s["router_spare_connections"][-1])
for t, r in zip(s["timeline_ms"], rl):
    print("   first %.1f last %.1f | router late max %.1f sum %.1f cpu %.1f" % (t["first token after recovery"], t["last stream resumed"], r["max_ms"], r["sum_ms"], r["cpu_ms"]))
PY
