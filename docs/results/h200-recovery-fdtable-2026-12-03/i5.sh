#!/usr/bin/env bash
# device call 5 (s23): a second failure during the recovery (--kill-successor), default mode, 512
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/i5; mkdir -p "$OUT" "$R" /tmp/hfw
t0=$(date +%s)
HF_ROUTER_WORKERS=4 timeout 200 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 2 \
  --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --isolated --no-deterministic --kill-successor --weights-dir /tmp/hfw/w \
  --json > "$R/rec-kill2.json" 2> "$R/rec-kill2.err"
echo "recovery kill2 rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -5 "$R/rec-kill2.err"
tar czf "$OUT/i5.tgz" -C "$R" .
