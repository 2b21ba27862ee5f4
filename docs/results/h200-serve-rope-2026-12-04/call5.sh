#!/usr/bin/env bash
# device call 5 (s26): gpu tests of engines/batched; the add+norm kernel A/B (probe, and serve against the rope-only
# model_runner.py of fb762fc); 8b recovery 64 + 16, fast mode, 5 kills, with both kernels
set -u
OUT=${OUT:-/tmp/out}; R=$OUT/k5; mkdir -p "$R" /tmp/hfw/s /tmp/hfw/w
t0=$(date +%s)
timeout 200 python3 -m pytest -p no:cacheprovider -m gpu tests/engine_batched -q --timeout 150 > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s" ; tail -4 "$R/gpu_tests.log"
timeout 120 python3 scripts/probe_decode_step.py 8b 1,64,256 130 fused,unfused-add,torch-rope,fused > "$R/probe.jsonl" 2> /tmp/probe.err
echo "probe rc=$?" ; grep -v '"top"' "$R/probe.jsonl"
cp engines/batched/model_runner.py /tmp/mr_new.py
for way in new prev new; do
  if [ $way = prev ]; then cp .devtree/model_runner_prev.py engines/batched/model_runner.py; else cp /tmp/mr_new.py engines/batched/model_runner.py; fi
  t0=$(date +%s)
  timeout 110 python3 -m holdfast.main bench serve --concurrency 64,256 --max-tokens 128 --weights-dir /tmp/hfw/s \
    > "/tmp/serve-$way-$t0.json" 2> /dev/null
  echo "serve $way rc=$? in $(( $(date +%s) - t0 )) s" 
  python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for m,rows in d['modes'].items():
    for r in rows: print(sys.argv[2], m, r['concurrency'], r.get('decode_tokens_per_s'), r.get('share_of_roofline'), r['itl_ms'])
" "/tmp/serve-$way-$t0.json" $way 2>&1 | tail -3
  (echo -n "{\"way\": \"$way\", \"report\": "; cat "/tmp/serve-$way-$t0.json"; echo "}") >> "$R/serve.jsonl"
done
cp /tmp/mr_new.py engines/batched/model_runner.py
t0=$(date +%s)
timeout 150 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
  --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$R/rec13-fast.json" 2> /dev/null
echo "recovery 13 fast rc=$? in $(( $(date +%s) - t0 )) s" 
python3 .devtree/an.py "$R"/rec13-fast.json 2>&1 | grep -v "^ \|phases" | head -12
