#!/usr/bin/env bash
# Death marks (services/agent/mark_waiter.py) against the PF_EXITING poll alone, on a GPU host: do they see a
# death sooner there without the 2-core machine's later p99 (docs/benchmarks.md "Failure detection")?
# Runs ON the device, one 10-minute call:
#   bash scripts/device_bundle.sh && rm -rf .devpack && mkdir -p .devpack && tar -C .device -cJf .devpack/bin.tar.xz bin
#   run: DEVICE_CMD="bash scripts/device_death_marks.sh" bash scripts/device_run.sh   carry: [".whl", ".devpack"]
# Writes to $OUT: host.txt, detect.json (60 kills a way, engines holding 256 MiB of host memory), summary.txt
# (each recovery run: gap p99, the timeline's `detected` and first token after the kill), reports.tar.xz.
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
start=$(date +%s); w=/tmp/hfw; mkdir -p "$w"
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
# ~1 s a kill on an H100 host, both ways (2026-12-06): 60 kills a way in ~2 minutes
timeout 200 python3 -m holdfast.main bench detect --kills 60 --json > "$OUT/detect.json" 2> /tmp/detect.err
tail -c 400 /tmp/detect.err
one() {  # label, then true or false: the agent's death marks
  local label=$1 marks=$2
  local left=$(( ${BUDGET:-580} - ($(date +%s) - start) )); (( left < 45 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  HF_DEATH_MARKS=$marks timeout "$left" python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 \
    --streams 64 --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 \
    --no-deterministic --secure --json --weights-dir "$w" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"
  python3 - "/tmp/r-$label.json" "$label" >> /tmp/summary.txt <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["sigkill"]
except (OSError, ValueError, KeyError) as e:
    print(sys.argv[2], "no report:", e)
    sys.exit()
marks = [(t.get("detected"), t.get("successor assigned"), t.get("first token after recovery")) for t in s["timeline_ms"]]
print(sys.argv[2], "gap", s.get("largest_gap_ms"), "lost", s.get("lost"), "detected/assigned/first token", marks,
      "seen", s.get("detected_as"))
EOF
  rm -rf /tmp/holdfast-demo-*
}
for i in 1 2 3 4 5 6; do
  if (( i % 2 )); then one M$i true; one P$i false; else one P$i false; one M$i true; fi
done
cp /tmp/summary.txt "$OUT/"
cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-*.json r-*.err 2>/dev/null
cat /tmp/summary.txt
