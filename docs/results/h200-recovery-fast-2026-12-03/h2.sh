#!/usr/bin/env bash
# device call 2 (s22): recovery in the default fast mode against deterministic (4 router workers); then the gpu suite
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/h2; mkdir -p "$OUT" "$R" /tmp/hfw
for cfg in "det 512 --deterministic" "fast 512 --no-deterministic" "fast 2048 --no-deterministic"; do
  set -- $cfg; name=$1-$2
  t0=$(date +%s)
  HF_ROUTER_WORKERS=4 timeout 150 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
    --max-tokens 96 --kv-cache-gib 16 --step-tokens $2 --prefill-chunk 128 --isolated $3 --weights-dir /tmp/hfw/w \
    --json > "$R/rec-$name.json" 2> "$R/rec-$name.err"
  echo "recovery $name rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec-$name.err"
  tar czf "$R/logs-$name.tgz" -C /tmp/hfw/w stack/logs 2>/dev/null; rm -rf /tmp/hfw/w/stack
  tar czf "$OUT/h2.tgz" -C "$R" .
done
t0=$(date +%s)
timeout 240 python3 -m pytest -p no:cacheprovider -q -m gpu tests/engine_batched tests/engine tests/gpu_manager tests/e2e \
  --continue-on-collection-errors > "$R/gpu-tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/gpu-tests.log"
tar czf "$OUT/h2.tgz" -C "$R" .
