"""Medians over the kills of local-W*.json (dispatched first) and local-X*.json (created first); run from here."""
import glob
import json
import statistics as st

MARKS = {"intent": "intent sent", "assigned": "successor assigned", "ready": "successor ready",
         "first": "first token after recovery", "last": "last stream resumed"}
for v in "WX":
    marks = {k: [] for k in MARKS}
    gap99, late99, lost = [], [], 0
    for f in sorted(glob.glob(f"local-{v}*.json")):
        s = json.load(open(f))["sigkill"]
        for t in s["timeline_ms"]:
            for k, label in MARKS.items():
                if label in t:
                    marks[k].append(t[label])
        gap99.append(round(s["largest_gap_ms"]["p99"], 1))
        late99.append(round(s["late_first_token_ms"]["p99"]))
        lost += s["lost"]
    print(v, {k: (round(min(x), 1), round(st.median(x), 1), round(max(x), 1)) for k, x in marks.items() if x},
          "gap p99 per run", gap99, "late p99 per run", late99, "lost", lost)
