#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 38 call 1: W the tree; X the tree with the incident's create confirmed before its dispatch (as before);
# B c83db56 (before the router's spares to the standby); then secure against plain (issue 20)
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
rm -rf /tmp/base && mkdir -p /tmp/base && tar -C /tmp/base -xJf .devtree/base.tar.xz && ln -s $PWD/.device /tmp/base/.device
timeout 40 python3 -m pytest -p no:cacheprovider -q -m gpu tests/engine_batched/test_drain_gpu.py 2>&1 | tail -4 > /tmp/gputest.txt
cat /tmp/gputest.txt
one() {  # label dir env... -- flags
  local label=$1 dir=$2; shift 2; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local left=$(( 215 - ($(date +%s) - start) )); (( left < 45 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  (cd $dir && env PYTHONPATH=/tmp/site:$dir "${envs[@]}" timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err")
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 300 "/tmp/r-$label.err" | tail -2
  python3 docs/results/dispatch-first-2026-12-05/summ.py "/tmp/r-$label.json" "$label" >> /tmp/summary.txt
  rm -rf /tmp/holdfast-demo-*
}
one W1 $PWD -- --secure
one X1 $PWD HF_DISPATCH_BEFORE_CREATE=false -- --secure
one B1 /tmp/base -- --secure
one W2 $PWD -- --secure
cat /tmp/gputest.txt >> /tmp/summary.txt
cp /tmp/summary.txt "$OUT/"
cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-*.json r-*.err 2>/dev/null
grep -E "^[WXBPS][0-9] " /tmp/summary.txt
