#!/usr/bin/env bash
# device call 3 (s23): fd table reserved at start (default) against not (HF_FD_RESERVE=0), alternated, default mode 512
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/i3; mkdir -p "$OUT" "$R" /tmp/hfw
ulimit -n >> "$R/steps.txt"
for name in off1 on1 off2 on2; do
  case $name in on*) fr=4096;; *) fr=0;; esac
  t0=$(date +%s)
  HF_FD_RESERVE=$fr HF_ENGINE_LOOP_WATCH_S=0.5 HF_ROUTER_WORKERS=4 timeout 100 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
    --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --isolated --no-deterministic --weights-dir /tmp/hfw/w \
    --json > "$R/rec-$name.json" 2> "$R/rec-$name.err"
  echo "recovery $name rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec-$name.err"
  rm -rf /tmp/hfw/w/stack
  tar czf "$OUT/i3.tgz" -C "$R" .
done
