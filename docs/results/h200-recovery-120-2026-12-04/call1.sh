#!/usr/bin/env bash
# device call 1 (s26): gpu tests of the drawn weights; 120 GiB-class recovery under 64 + 16 streams (drawn weights)
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/k1; mkdir -p "$OUT" "$R" /tmp/hfw
git log --oneline -1 > "$R/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$R/smi0.txt" 2>&1
t0=$(date +%s)
timeout 90 python3 -m pytest -p no:cacheprovider -m gpu tests/engine/test_model.py -q --timeout 80 > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/gpu_tests.log"
( while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader >> "$R/smi.txt" 2>&1; sleep 2; done ) &
smi=$!
t0=$(date +%s)
timeout 270 python3 -m holdfast.main bench recovery --backend cuda --weights-gib ${GIB:-120} --streams 64 --late 16 --trials 3 \
  --max-tokens 96 --kv-cache-gib 6 --step-tokens 512 --prefill-chunk 128 --no-deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$R/rec120-fast.json" 2> "$R/rec120-fast.err"
echo "recovery 120 fast rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -5 "$R/rec120-fast.err"
t0=$(date +%s)
timeout 200 python3 -m holdfast.main bench recovery --backend cuda --weights-gib ${GIB:-120} --streams 64 --late 16 --trials 2 \
  --max-tokens 96 --kv-cache-gib 6 --step-tokens 512 --prefill-chunk 128 --deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$R/rec120-det.json" 2> "$R/rec120-det.err"
echo "recovery 120 det rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -5 "$R/rec120-det.err"
kill $smi
python3 .devtree/an.py "$R"/rec120-*.json 2>&1 | head -60
tar czf "$OUT/k1.tgz" -C "$R" .
