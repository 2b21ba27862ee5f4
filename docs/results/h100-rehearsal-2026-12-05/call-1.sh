#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 36: the RW-shadow gpu test (never ran), then 64+16 recovery at head: secure/plain interleaved, 3 kills a run
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"; git log --oneline -1 >> "$OUT/host.txt" 2>/dev/null
timeout 150 python3 -m pytest -p no:cacheprovider -q -m gpu tests/client/test_reservation.py 2>&1 | tail -8 > "$OUT/gputest.txt"
cat "$OUT/gputest.txt"
one() {  # label -- flags
  local label=$1; shift; shift
  local left=$(( 480 - ($(date +%s) - start) )); (( left < 45 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 400 "/tmp/r-$label.err" | tail -3
  python3 .devtree/summ.py "/tmp/r-$label.json" "$label" >> "$OUT/summary.txt"
  cp "/tmp/r-$label.json" "$OUT/" 2>/dev/null
}
one sec -- --secure
one plain -- --no-secure
one sec2 -- --secure
one plain2 -- --no-secure
cat "$OUT/summary.txt"
