#!/usr/bin/env bash
# device call 4 (s23): the gpu-marked suite at HEAD, then the fd reservation's repeat: default mode twice, deterministic once
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/i4; mkdir -p "$OUT" "$R" /tmp/hfw
git log --oneline -1 > "$R/steps.txt" 2>/dev/null || true
t0=$(date +%s)
timeout 250 python3 -m pytest -p no:cacheprovider -q -m gpu tests/engine_batched tests/engine tests/gpu_manager tests/e2e tests/common \
  > "$R/gpu-tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -2 "$R/gpu-tests.log"
tar czf "$OUT/i4.tgz" -C "$R" .
for name in fast3 det1 fast4; do
  case $name in det*) mode=--deterministic;; *) mode=--no-deterministic;; esac
  t0=$(date +%s)
  HF_ENGINE_LOOP_WATCH_S=0.5 HF_ROUTER_WORKERS=4 timeout 100 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
    --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --isolated $mode --weights-dir /tmp/hfw/w \
    --json > "$R/rec-$name.json" 2> "$R/rec-$name.err"
  echo "recovery $name rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec-$name.err"
  rm -rf /tmp/hfw/w/stack
  tar czf "$OUT/i4.tgz" -C "$R" .
done
