#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# issues 17/20: 64+16 recovery under load, fast mode, 3 kills a run: lease table inline (new) vs its worker thread
# (old, HF_DB_THREAD=1), and secure vs plain (--no-secure), interleaved until the call's time is nearly spent
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"; git log --oneline -1 >> "$OUT/host.txt"
one() {  # label env... -- flags
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local left=$(( 560 - ($(date +%s) - start) )); (( left < 100 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  env "${envs[@]}" timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"
  python3 - "/tmp/r-$label.json" "$label" >> "$OUT/summary.txt" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no report", e); sys.exit()
s = d["sigkill"]
rec = s["successor"]["recovery"]
print(sys.argv[2], "secure", d.get("secure"), "gap", s.get("largest_gap_ms"), "late_first", s.get("late_first_token_ms"),
      "lost", s.get("lost"), "recomputed", s.get("successor", {}).get("recomputed_prefill_tokens"))
for t, r in zip(s["timeline_ms"], rec):
    m = r.get("memory_ms", {})
    print("  ready %.1f first_token %.1f frozen %.1f | request %s map %s leases %s freed %s | adopt %s" % (
        t.get("successor ready", -1), t.get("first token after recovery", -1), t.get("frozen", -1),
        m.get("request_ms"), m.get("map_ms"), m.get("leases"), m.get("unused_freed_ms"), r.get("adopt_ms")))
PY
  cp "/tmp/r-$label.json" "$OUT/" 2>/dev/null
}
one inline-secure HF_DB_THREAD=0 -- --secure
one thread-secure HF_DB_THREAD=1 -- --secure
one inline-plain HF_DB_THREAD=0 -- --no-secure
one inline-secure2 HF_DB_THREAD=0 -- --secure
one thread-secure2 HF_DB_THREAD=1 -- --secure
one inline-plain2 HF_DB_THREAD=0 -- --no-secure
cat "$OUT/summary.txt"
