#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 37 call 1: the head with the successor's first passes' make-up and the manager's split
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
one() {  # label env... -- flags
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local left=$(( 540 - ($(date +%s) - start) )); (( left < 45 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  env "${envs[@]}" timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 400 "/tmp/r-$label.err" | tail -3
  python3 .devtree/summ.py "/tmp/r-$label.json" "$label" >> "$OUT/summary.txt"
  cp "/tmp/r-$label.json" "$OUT/" 2>/dev/null
  rm -rf /tmp/holdfast-demo-*
}
one S1 X=1 -- --secure
one P1 X=1 -- --no-secure
one S2 X=1 -- --secure
one P2 X=1 -- --no-secure
cat "$OUT/summary.txt"
