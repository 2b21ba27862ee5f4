#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 40 call 1: the head (a7af3da), 64 + 16 streams, fast mode, 3 kills a run: secure (issue 17's "then 50 ms")
# interleaved with --no-secure (issue 20's recovery pairs), order rotated
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"; git log --oneline -1 >> "$OUT/host.txt" 2>&1
one() {  # label flags...
  local label=$1; shift
  local left=$(( ${BUDGET:-560} - ($(date +%s) - start) )); (( left < 60 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 300 "/tmp/r-$label.err" | tail -2
  python3 docs/results/dispatch-first-2026-12-05/summ.py "/tmp/r-$label.json" "$label" >> /tmp/summary.txt
  rm -rf /tmp/holdfast-demo-*
}
one S1 --secure
one P1 --no-secure
one P2 --no-secure
one S2 --secure
one S3 --secure
one P3 --no-secure
one S4 --secure
cp /tmp/summary.txt "$OUT/"
cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-*.json r-*.err 2>/dev/null
grep -E "^[SP][0-9] " /tmp/summary.txt
