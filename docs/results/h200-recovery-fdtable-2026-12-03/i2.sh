#!/usr/bin/env bash
# device call 2 (s23): default mode, 512 budget, loop watch on, a /proc sampler of every engine's threads beside it
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/i2; mkdir -p "$OUT" "$R" /tmp/hfw
cat /proc/sys/kernel/yama/ptrace_scope 2>&1 | head -1 > "$R/ptrace_scope.txt"; uname -r >> "$R/ptrace_scope.txt"
for name in p1; do
  t0=$(date +%s)
  python3 .devtree/sched_probe.py "$R/probe-$name.json" 110 > "$R/probe-$name.log" 2>&1 &
  probe=$!
  HF_ENGINE_LOOP_WATCH_S=0.5 HF_ROUTER_WORKERS=4 timeout 105 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
    --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --isolated --no-deterministic --weights-dir /tmp/hfw/w \
    --json > "$R/rec-$name.json" 2> "$R/rec-$name.err"
  echo "recovery $name rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -3 "$R/rec-$name.err"
  kill -INT $probe 2>/dev/null; wait $probe; cat "$R/probe-$name.log"
  rm -rf /tmp/hfw/w/stack
  tar czf "$OUT/i2.tgz" -C "$R" .
done
