#!/usr/bin/env bash
# A successor's first step with the kernels a launch runs beside its graph loaded before the failure (model_runner.py
# `_warm_launch`: the argmax, the row gather, the fed tokens' select and copy), against the runner before it, on a
# GPU host; with the runner's GPU tests and first_launch.py (a bare tiny-model runner's first launches).
# Runs ON the device, one 10-minute call:
#   bash scripts/device_bundle.sh && rm -rf .devpack && mkdir -p .devpack && tar -C .device -cJf .devpack/bin.tar.xz bin
#   run: DEVICE_CMD="bash scripts/device_warm_kernels.sh" bash scripts/device_run.sh
#        carry: [".whl", ".devpack", ".devtree"]   (.devtree/old44/model_runner.py: the runner before the change)
# Writes to $OUT: host.txt, gpu_tests.log, first_launch.txt, summary.txt (scripts/device_lib.sh), reports.tar.xz.
. scripts/device_lib.sh
device_prelude
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine_batched/test_model_runner_gpu.py \
  tests/engine_batched/test_prepared_standby_gpu.py > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"
mkdir -p /tmp/new && cp engines/batched/model_runner.py /tmp/new/
for m in base prof; do timeout 60 python3 docs/results/h100-s44-2026-12-06/first_launch.py $m; done > "$OUT/first_launch.txt" 2>&1
use() { if [ "$1" = old ]; then cp .devtree/old44/model_runner.py engines/batched/; else cp /tmp/new/model_runner.py engines/batched/; fi; }
for i in 1 2 3 4 5; do
  if (( i % 2 )); then use new; recovery_one N$i; use old; recovery_one O$i
  else use old; recovery_one O$i; use new; recovery_one N$i; fi
done
use new
device_finish
