#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# session 36 call 5: the rehearsal (scratch cache holding a whole context) vs none
start=$(date +%s); w=/tmp/hfw; mkdir -p $w
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
timeout 90 python3 -m pytest -p no:cacheprovider -q -m gpu tests/engine_batched/test_prepared_standby_gpu.py 2>&1 | tail -8 > "$OUT/gputest.txt"
cat "$OUT/gputest.txt"
one() {  # label env... -- flags
  local label=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local left=$(( 500 - ($(date +%s) - start) )); (( left < 45 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  env HF_KEEP_TMP=1 "${envs[@]}" timeout $left python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 \
    --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic \
    --json --weights-dir $w "$@" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"; tail -c 400 "/tmp/r-$label.err" | tail -3
  python3 .devtree/summ.py "/tmp/r-$label.json" "$label" >> "$OUT/summary.txt"
  cp "/tmp/r-$label.json" "$OUT/" 2>/dev/null
  echo "== $label" >> "$OUT/reh.txt"; grep -h "rehears" /tmp/holdfast-demo-*/stack/state/engines/*.log 2>/dev/null | cut -c1-400 >> "$OUT/reh.txt"; rm -rf /tmp/holdfast-demo-*
}
one R HF_ENGINE_REHEARSE=auto -- --secure
one A HF_ENGINE_REHEARSE=off -- --secure
one R2 HF_ENGINE_REHEARSE=auto -- --secure
one A2 HF_ENGINE_REHEARSE=off -- --secure
cat "$OUT/summary.txt"
