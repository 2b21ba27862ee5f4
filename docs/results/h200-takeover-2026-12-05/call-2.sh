#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 37 call 2: views taken whole, held grant, deferred adopted hashes (N) against 236d6dd (B), interleaved
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
rm -rf /tmp/base && mkdir -p /tmp/base && tar -C /tmp/base -xJf .devtree/base.tar.xz && ln -s $PWD/.device /tmp/base/.device
timeout 150 python3 -m pytest -p no:cacheprovider -q -m gpu tests/engine_batched/test_prepared_standby_gpu.py tests/client/test_reservation.py 2>&1 | tail -6 > "$OUT/gputest.txt"
cat "$OUT/gputest.txt"
one() {  # label dir -- flags
  local label=$1 dir=$2; shift 3
  local left=$(( 560 - ($(date +%s) - start) )); (( left < 50 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err")
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 300 "/tmp/r-$label.err" | tail -2
  python3 .devtree/summ.py "/tmp/r-$label.json" "$label" >> "$OUT/summary.txt"
  cp "/tmp/r-$label.json" "$OUT/" 2>/dev/null
  rm -rf /tmp/holdfast-demo-*
}
one N1 $PWD -- --secure
one B1 /tmp/base -- --secure
one N2 $PWD -- --secure
one B2 /tmp/base -- --secure
one N3 $PWD -- --secure
one B3 /tmp/base -- --secure
grep -E "^[NB][0-9] " "$OUT/summary.txt"
