#!/usr/bin/env bash
# device call 2 (s27): gpu tests of the model runner (table fill through numpy); 64 + 256 streams A/B in one call:
# the code before (server.py, http_state.py, model_runner.py of 7c7862e) vs now, and now at switch intervals
# 1 and 0.5 ms; then the served table (1/16/64/256, both modes, the plain loop)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw
t0=$(date +%s)
timeout 200 python3 -m pytest -p no:cacheprovider -m gpu tests/engine_batched/test_model_runner_gpu.py -q --timeout 150 > "$OUT/gpu_tests.log" 2>&1
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
for p in d.get('plain_decode') or []:
    print(sys.argv[2], 'plain', p)
PY
}
mkdir -p /tmp/new && for f in server.py http_state.py model_runner.py; do cp engines/batched/$f /tmp/new/$f; done
use() { for f in server.py http_state.py model_runner.py; do cp "$1/$f" engines/batched/$f; done; }
run() {  # name extra-engine-args
  local name=$1; local t0=$(date +%s)
  timeout 150 python3 -m holdfast.main bench serve --concurrency 64,256 --max-tokens 256 --drawn-weights \
    --weights-dir /tmp/hfw --engine-args "$2" > "$OUT/ab-$name.json" 2> /dev/null
  echo "serve $name rc=$? in $(( $(date +%s) - t0 )) s"; summ "$OUT/ab-$name.json" "$name" 2>&1 | tail -2
}
use .devtree/prev27; run prev ""
use /tmp/new; run new ""
run new-sw1 "--switch-interval-ms 1"
run new-sw05 "--switch-interval-ms 0.5"
use .devtree/prev27; run prev2 ""
use /tmp/new; run new2 ""
t0=$(date +%s)
timeout 280 python3 -m holdfast.main bench serve --concurrency 1,16,64,256 --max-tokens 256 --drawn-weights \
  --weights-dir /tmp/hfw --both-modes --plain > "$OUT/table.json" 2> /dev/null
echo "table rc=$? in $(( $(date +%s) - t0 )) s"; summ "$OUT/table.json" table
