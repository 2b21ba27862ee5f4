#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# issue 17/20: the new gpu test, then 64+16 recovery A/B: old (lease table on a worker, write access after the
# grant) vs new (inline, write access at the assignment), and new with --no-secure; fast mode, 3 kills a run
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
one() {  # label env... -- flags
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local left=$(( 210 - ($(date +%s) - start) )); (( left < 40 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  env "${envs[@]}" timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 400 "/tmp/r-$label.err" | tail -3
  python3 - "/tmp/r-$label.json" "$label" >> "$OUT/summary.txt" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no report", e); sys.exit()
s = d["sigkill"]
rec = s["successor"]["recovery"]
print(sys.argv[2], "secure", d.get("secure"), "gap", s.get("largest_gap_ms"), "late_first", s.get("late_first_token_ms"),
      "resumed", s.get("stream_resumed_after_kill_ms"), "lost", s.get("lost"),
      "recomputed", s.get("successor", {}).get("recomputed_prefill_tokens"), "control gap", d["no_failure"].get("largest_gap_ms"))
for t, r in zip(s["timeline_ms"], rec):
    m = r.get("memory_ms", {})
    print("  ready %.1f first_token %.1f frozen %.1f | request %s map %s leases %s | adopt %s fence %s" % (
        t.get("successor ready", -1), t.get("first token after recovery", -1), t.get("frozen", -1),
        m.get("request_ms"), m.get("map_ms"), m.get("leases"), r.get("adopt_ms"), r.get("fence")))
PY
  cp "/tmp/r-$label.json" "$OUT/" 2>/dev/null
}
one rw HF_SHADOW_KV_RW=1 -- --secure
one soon HF_SHADOW_KV_RW=0 -- --secure
one rw2 HF_SHADOW_KV_RW=1 -- --secure
one soon2 HF_SHADOW_KV_RW=0 -- --secure
cat "$OUT/summary.txt"
