#!/usr/bin/env bash
# device call 2 (s26): 120 GiB class at a step budget of 192; 8b (13 GiB) recovery 64 + 16, default mode, 5 kills
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/k2; mkdir -p "$OUT" "$R" /tmp/hfw
git log --oneline -1 > "$R/commit.txt" 2>/dev/null
t0=$(date +%s)
timeout 200 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 120 --streams 64 --late 16 --trials 3 \
  --max-tokens 96 --kv-cache-gib 6 --step-tokens 192 --prefill-chunk 128 --no-deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$R/rec120-b192.json" 2> "$R/rec120-b192.err"
echo "recovery 120 b192 rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec120-b192.err"
t0=$(date +%s)
timeout 240 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
  --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$R/rec13-fast.json" 2> "$R/rec13-fast.err"
echo "recovery 13 fast rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec13-fast.err"
t0=$(date +%s)
timeout 120 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 3 \
  --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$R/rec13-det.json" 2> "$R/rec13-det.err"
echo "recovery 13 det rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec13-det.err"
python3 .devtree/an.py "$R"/rec*.json 2>&1 | grep -v "^ \|phases" | head -60
tar czf "$OUT/k2.tgz" -C "$R" .
