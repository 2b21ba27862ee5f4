#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 40 call 4 (issue 20): controlplane burst pairs secure/plain on the 16-core host, order rotated; then
# recovery pairs on the GPU (64 + 16, fast, 3 kills a run), the tree, order rotated
start=$(date +%s); w=/tmp/hfw; mkdir -p $w /tmp/cp
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
for r in 1 2 3 4 5 6 7 8; do
  if (( r % 2 )); then order="secure plain"; else order="plain secure"; fi
  for mode in $order; do
    left=$(( 200 - ($(date +%s) - start) )); (( left < 30 )) && break 2
    flag="--secure"; [[ $mode == plain ]] && flag="--no-secure"
    timeout $left python3 -m holdfast.main bench controlplane --nodes 1000 --gpus-per-node 8 --incidents 8000 --json $flag \
      > "/tmp/cp/round$r-$mode.json" 2> "/tmp/cp/round$r-$mode.err" || { echo "cp $r $mode failed"; tail -3 /tmp/cp/round$r-$mode.err; }
    python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], d['incidents_per_s'], d['latency_ms']['p99'], d['cpu_ms_per_incident'])" \
      "/tmp/cp/round$r-$mode.json" "cp round $r $mode" 2>&1 | tee -a /tmp/cp-summary.txt
  done
done
one() {  # label flags...
  local label=$1; shift
  local left=$(( ${BUDGET:-455} - ($(date +%s) - start) )); (( left < 40 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 300 "/tmp/r-$label.err" | tail -2
  python3 docs/results/dispatch-first-2026-12-05/summ.py "/tmp/r-$label.json" "$label" >> /tmp/summary.txt
  rm -rf /tmp/holdfast-demo-*
}
for i in 1 2 3 4 5; do
  if (( i % 2 )); then one P1$i --no-secure; one S1$i --secure; else one S1$i --secure; one P1$i --no-secure; fi
done
cp /tmp/summary.txt /tmp/cp-summary.txt "$OUT/" 2>/dev/null
cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-*.json r-*.err cp 2>/dev/null
grep -E "^[SP][0-9]+ " /tmp/summary.txt
