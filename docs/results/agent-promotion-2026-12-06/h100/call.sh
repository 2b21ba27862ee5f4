#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 39 call 3: R (the tree, 939c7ad: drain page page-locked beside start-up; the agent promoting its standby)
# against H (b7b1d28), secure, interleaved, 4 kills a run; GPU tests of the drain mark and the prepared standby
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
rm -rf /tmp/head && mkdir -p /tmp/head && tar -C /tmp/head -xJf .devtree/head.tar.xz && ln -s $PWD/.device /tmp/head/.device
timeout 100 python3 -m pytest -p no:cacheprovider -q -m gpu tests/engine_batched/test_drain_gpu.py tests/engine_batched/test_prepared_standby_gpu.py 2>&1 | tail -4 > /tmp/gputest.txt
cat /tmp/gputest.txt
one() {  # label dir env... -- flags
  local label=$1 dir=$2; shift 2; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local left=$(( ${BUDGET:-330} - ($(date +%s) - start) )); (( left < 50 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  (cd $dir && env PYTHONPATH=/tmp/site:$dir "${envs[@]}" timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err")
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 300 "/tmp/r-$label.err" | tail -2
  python3 .devtree/summ.py "/tmp/r-$label.json" "$label" >> /tmp/summary.txt
  rm -rf /tmp/holdfast-demo-*
}
one R1 $PWD -- --secure
one H1 /tmp/head -- --secure
one R2 $PWD -- --secure
one H2 /tmp/head -- --secure
cat /tmp/gputest.txt >> /tmp/summary.txt
cp /tmp/summary.txt "$OUT/"
cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-*.json r-*.err 2>/dev/null
grep -E "^[WXBPSRH][0-9] " /tmp/summary.txt
