#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 40 call 2 (issue 20): controlplane burst pairs secure/plain on the 16-core host, order rotated;
# then more GPU recovery pairs (64 + 16, fast, 3 kills a run)
start=$(date +%s); w=/tmp/hfw; mkdir -p $w $OUT/cp
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"; git log --oneline -1 >> "$OUT/host.txt" 2>&1
for r in 1 2 3 4; do
  if (( r % 2 )); then order="secure plain"; else order="plain secure"; fi
  for mode in $order; do
    left=$(( 300 - ($(date +%s) - start) )); (( left < 40 )) && break 2
    flag="--secure"; [[ $mode == plain ]] && flag="--no-secure"
    t0=$(date +%s)
    timeout $left python3 -m holdfast.main bench controlplane --nodes 1000 --gpus-per-node 8 --incidents 8000 --json $flag \
      > "$OUT/cp/round$r-$mode.json" 2> "/tmp/cp-$r-$mode.err" || { echo "cp $r $mode failed"; tail -3 /tmp/cp-$r-$mode.err; }
    echo "cp round $r $mode ($(( $(date +%s) - t0 )) s): $(python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if isinstance(v, (int, float))})" "$OUT/cp/round$r-$mode.json" 2>&1 | head -c 600)"
  done
done
one() {  # label flags...
  local label=$1; shift
  local left=$(( ${BUDGET:-560} - ($(date +%s) - start) )); (( left < 40 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 300 "/tmp/r-$label.err" | tail -2
  python3 docs/results/dispatch-first-2026-12-05/summ.py "/tmp/r-$label.json" "$label" >> /tmp/summary2.txt
  rm -rf /tmp/holdfast-demo-*
}
one P4 --no-secure
one S5 --secure
one S6 --secure
one P5 --no-secure
one P6 --no-secure
one S7 --secure
cp /tmp/summary2.txt "$OUT/" 2>/dev/null
cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-P[456].* r-S[567].* cp-*.err 2>/dev/null
grep -E "^[SP][0-9] " /tmp/summary2.txt
