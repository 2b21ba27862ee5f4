#!/usr/bin/env bash
# The forty-seventh session's first device call (2026-12-07): the gpu-marked tests of the parts the forty-sixth
# session changed (artifact format 2 and its trust checks, the host tier, peer copies, level-2 sleep's wake copy)
# with the agent's and the batched engine's, then one recovery run under load (64 streams + 16 late, 3 SIGKILLs,
# fast mode, the 8b-shaped 13 GiB model) on the same stack.
# Run ON the device: DEVICE_CMD="bash docs/results/h100-s47-2026-12-07/run.sh" bash scripts/device_run.sh
# (carry [".whl", ".devpack"]).
. scripts/device_lib.sh
device_prelude
timeout 330 python3 -m pytest -p no:cacheprovider -m gpu tests/gpu_manager tests/agent tests/engine_batched -q \
  --timeout 150 > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/gpu_tests.log"
BUDGET=${BUDGET:-575} recovery_one S47
device_finish
