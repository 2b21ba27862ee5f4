#!/usr/bin/env bash
# device call 1 (s22): 4 router workers (SO_REUSEPORT), step budget 512 (repeat of s21 call 6) against 2048 and 1024
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/h1; mkdir -p "$OUT" "$R" /tmp/hfw
nproc | tee -a "$R/steps.txt"
for b in 512 2048 1024; do
  t0=$(date +%s)
  HF_ROUTER_WORKERS=4 timeout 170 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
    --max-tokens 96 --kv-cache-gib 16 --step-tokens $b --prefill-chunk 128 --isolated --weights-dir /tmp/hfw/w \
    --json > "$R/rec-b$b.json" 2> "$R/rec-b$b.err"
  echo "recovery budget=$b rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec-b$b.err"
  tar czf "$R/logs-$b.tgz" -C /tmp/hfw/w stack/logs 2>/dev/null; rm -rf /tmp/hfw/w/stack
  tar czf "$OUT/h1.tgz" -C "$R" .
done
