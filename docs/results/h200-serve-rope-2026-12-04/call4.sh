#!/usr/bin/env bash
# device call 4 (s26): gpu tests of engines/batched; the rope kernel A/B in the decode probe; bench serve at 64 and
# 256 streams with the rope kernel against the code before it (model_runner.py swapped), in one call
set -u
OUT=${OUT:-/tmp/out}; R=$OUT/k4; mkdir -p "$R" /tmp/hfw/s
t0=$(date +%s)
timeout 200 python3 -m pytest -p no:cacheprovider -m gpu tests/engine_batched/test_fused_gpu.py tests/engine_batched/test_model_runner_gpu.py tests/engine_batched/test_attention_gpu.py tests/engine_batched/test_prepared_standby_gpu.py -q --timeout 150 > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"; tail -4 "$R/gpu_tests.log"
timeout 120 python3 scripts/probe_decode_step.py 8b 1,64,256 130 rope,torch-rope,rope > "$R/probe.jsonl" 2> "$R/probe.err"
echo "probe rc=$?" | tee -a "$R/steps.txt"; grep -v '"top"' "$R/probe.jsonl"
cp engines/batched/model_runner.py /tmp/mr_new.py
for way in new prev new; do
  if [ $way = prev ]; then cp .devtree/model_runner_prev.py engines/batched/model_runner.py; else cp /tmp/mr_new.py engines/batched/model_runner.py; fi
  t0=$(date +%s)
  timeout 110 python3 -m holdfast.main bench serve --concurrency 64,256 --max-tokens 128 --weights-dir /tmp/hfw/s \
    > "$R/serve-$way-$t0.json" 2> "$R/serve-$way-$t0.err"
  echo "serve $way rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"
  python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for m,rows in d['modes'].items():
    for r in rows: print(sys.argv[2], m, r['concurrency'], r.get('decode_tokens_per_s'), r.get('share_of_roofline'))
" "$R/serve-$way-$t0.json" $way 2>&1 | tail -3
done
cp /tmp/mr_new.py engines/batched/model_runner.py
