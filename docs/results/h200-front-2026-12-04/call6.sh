#!/usr/bin/env bash
# device call 6 (s27): what moved the recovery figures: 8b 64 + 16 fast mode, 3 kills each, engines of 7c7862e (the
# session's start) and of cc8c9c2 (the front), alternated in one call, same router and stack
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw/w
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
rec() {  # name pythonpath trials
  local t0=$(date +%s)
  PYTHONPATH=$2 timeout 150 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 \
    --trials $3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic --drawn-weights \
    --weights-dir /tmp/hfw/w --json > "$OUT/rec-$1.json" 2> "/tmp/rec-$1.err"
  echo "recovery $1 rc=$? in $(( $(date +%s) - t0 )) s"; tail -2 "/tmp/rec-$1.err" | cut -c1-300
  python3 .devtree/an.py "$OUT/rec-$1.json" 2>&1 | grep -v "^ T\|^     \|phases" | head -10
}
NOW=$PYTHONPATH; OLD=/tmp/site:$PWD/.devtree/prev7c:$PWD
rec start1 "$OLD" 3; rec front1 "$NOW" 3; rec start2 "$OLD" 3
