#!/usr/bin/env bash
# device call 8 (s26): journal block-table growth in one copy a step: gpu tests that write the journal on CUDA;
# serve 64 and 256 streams against HEAD's journal.py/pipeline.py/backup.py (swapped), new / before / new;
# 8b recovery 64 + 16, fast mode, 5 kills
set -u
OUT=${OUT:-/tmp/out}; R=$OUT/k8; mkdir -p "$R" /tmp/hfw/s /tmp/hfw/w
t0=$(date +%s)
timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/engine_batched/test_drain_gpu.py tests/engine_batched/test_kv_backup_gpu.py tests/engine_batched/test_model_runner_gpu.py -q --timeout 120 > "$R/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 "$R/gpu_tests.log"
mkdir -p /tmp/new && for f in journal.py pipeline.py backup.py; do cp engines/batched/$f /tmp/new/$f; done
for way in new prev new; do
  for f in journal.py pipeline.py backup.py; do
    if [ $way = prev ]; then cp .devtree/prev/$f engines/batched/$f; else cp /tmp/new/$f engines/batched/$f; fi
  done
  t0=$(date +%s)
  timeout 110 python3 -m holdfast.main bench serve --concurrency 64,256 --max-tokens 128 --weights-dir /tmp/hfw/s \
    > "/tmp/serve-$way-$t0.json" 2> /dev/null
  echo "serve $way rc=$? in $(( $(date +%s) - t0 )) s"
  python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for m,rows in d['modes'].items():
    for r in rows: print(sys.argv[2], m, r['concurrency'], r.get('decode_tokens_per_s'), r.get('share_of_roofline'), r['itl_ms'], r['ttft_ms'])
" "/tmp/serve-$way-$t0.json" $way 2>&1 | tail -3
  (echo -n "{\"way\": \"$way\", \"report\": "; cat "/tmp/serve-$way-$t0.json"; echo "}") >> "$R/serve.jsonl"
done
for f in journal.py pipeline.py backup.py; do cp /tmp/new/$f engines/batched/$f; done
t0=$(date +%s)
timeout 120 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 --trials 5 \
  --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$R/rec13-fast.json" 2> /dev/null
echo "recovery 13 fast rc=$? in $(( $(date +%s) - t0 )) s"
python3 .devtree/an.py "$R"/rec13-fast.json 2>&1 | grep -v "^ T\|^     \|phases" | head -12
