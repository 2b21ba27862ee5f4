#!/usr/bin/env bash
# The forty-fifth session's one H100 call (2026-12-06): the gpu-marked tests of the parts this session changed (the
# gpu_manager's keeper and lease table, the agent's engine link, the bounded events), then one recovery run under
# load as the forty-fourth's (64 streams + 16 late, 3 SIGKILLs, fast mode) to see the same stack on CUDA.
# Run ON the device: DEVICE_CMD="bash docs/results/h100-s45-2026-12-06/run.sh" bash scripts/device_run.sh
# (carry [".whl", ".devpack"]).
. scripts/device_lib.sh
device_prelude
timeout 300 python3 -m pytest -p no:cacheprovider -m gpu tests/gpu_manager tests/agent tests/engine_batched -q \
  --timeout 150 > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/gpu_tests.log"
BUDGET=${BUDGET:-560} recovery_one S45
device_finish
