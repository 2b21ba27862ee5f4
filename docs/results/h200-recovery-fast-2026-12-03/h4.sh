#!/usr/bin/env bash
# device call 4 (s22): fast mode, 512 budget, the successor's loop watch on and off, twice each, alternated
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/h4; mkdir -p "$OUT" "$R" /tmp/hfw
for name in on1 off1 on2 off2; do
  case $name in on*) w=0.5;; *) w=0;; esac
  t0=$(date +%s)
  HF_ENGINE_LOOP_WATCH_S=$w HF_ROUTER_WORKERS=4 timeout 100 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
    --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --isolated --no-deterministic --weights-dir /tmp/hfw/w \
    --json > "$R/rec-$name.json" 2> "$R/rec-$name.err"
  echo "recovery $name rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec-$name.err"
  rm -rf /tmp/hfw/w/stack
  tar czf "$OUT/h4.tgz" -C "$R" .
done
