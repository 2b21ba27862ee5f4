#!/usr/bin/env bash
# device call 3 (s27): the HTTP front as a process of its own. gpu tests of standby engines (their fronts);
# serve 64 + 256: the code before (e43d673's engines/, HTTP on a thread of the engine) vs now, alternated;
# 8b recovery 64 + 16 fast mode, 5 kills, now; 3 kills before
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw/s /tmp/hfw/w
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
t0=$(date +%s)
timeout 200 python3 -m pytest -p no:cacheprovider -m gpu tests/engine_batched/test_prepared_standby_gpu.py -q --timeout 150 > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/gpu_tests.log"
summ() {
python3 - "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, rows in d['modes'].items():
    for r in rows:
        print(sys.argv[2], m, r['concurrency'], 'decode', r.get('decode_tokens_per_s'), 'roof', r.get('share_of_roofline'),
              'itl', r['itl_ms'].get('p50'), r['itl_ms'].get('p99'), 'ttft', r['ttft_ms'].get('p50'), r['ttft_ms'].get('p99'),
              'step', r.get('engine_step_ms'))
PY
}
serve() {  # name pythonpath
  local t0=$(date +%s)
  PYTHONPATH=$2 timeout 150 python3 -m holdfast.main bench serve --concurrency 64,256 --max-tokens 256 --drawn-weights \
    --weights-dir /tmp/hfw/s > "$OUT/ab-$1.json" 2> /dev/null
  echo "serve $1 rc=$? in $(( $(date +%s) - t0 )) s"; summ "$OUT/ab-$1.json" "$1" 2>&1 | tail -2
}
NOW=$PYTHONPATH; PREV=/tmp/site:$PWD/.devtree/prevtree:$PWD
serve front1 "$NOW"; serve thread1 "$PREV"; serve front2 "$NOW"; serve thread2 "$PREV"
rec() {  # name pythonpath trials
  local t0=$(date +%s)
  PYTHONPATH=$2 timeout 200 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 \
    --trials $3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic --drawn-weights \
    --weights-dir /tmp/hfw/w --json > "$OUT/rec-$1.json" 2> "/tmp/rec-$1.err"
  echo "recovery $1 rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 "/tmp/rec-$1.err" | cut -c1-300
  python3 .devtree/an.py "$OUT/rec-$1.json" 2>&1 | grep -v "^ T\|^     \|phases" | head -10
}
rec front "$NOW" 5
rec thread "$PREV" 3
