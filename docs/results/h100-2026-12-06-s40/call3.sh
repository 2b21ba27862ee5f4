#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 40 call 3: N (the tree: an isolated takeover's rows written again only where they changed, its copies'
# indices without a blocking copy) against O (a7af3da), secure, interleaved, 64 + 16 streams, fast, 3 kills a run
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
rm -rf /tmp/base && mkdir -p /tmp/base && tar -C /tmp/base -xJf .devtree/base.tar.xz && ln -s $PWD/.device /tmp/base/.device
timeout 120 python3 -m pytest -p no:cacheprovider -q -m gpu tests/engine_batched/test_drain_gpu.py 2>&1 | tail -4 > /tmp/gputest.txt
cat /tmp/gputest.txt
one() {  # label dir flags...
  local label=$1 dir=$2; shift 2
  local left=$(( ${BUDGET:-400} - ($(date +%s) - start) )); (( left < 45 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err")
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 300 "/tmp/r-$label.err" | tail -2
  python3 docs/results/dispatch-first-2026-12-05/summ.py "/tmp/r-$label.json" "$label" >> /tmp/summary.txt
  rm -rf /tmp/holdfast-demo-*
}
for i in 1 2 3 4 5 6; do
  if (( i % 2 )); then one N$i $PWD --secure; one O$i /tmp/base --secure; else one O$i /tmp/base --secure; one N$i $PWD --secure; fi
done
cat /tmp/gputest.txt >> /tmp/summary.txt
cp /tmp/summary.txt "$OUT/"
cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-*.json r-*.err 2>/dev/null
grep -E "^[NO][0-9] " /tmp/summary.txt
