#!/usr/bin/env bash
# The forty-sixth session's device call (2026-12-07; 416 s of device time were left to the session): the gpu-marked
# tests of the gpu_manager, whose artifacts (format 2: the root hash covers the tensor table; read only from the
# manager's own files), host tier, peer copies and level-2 sleep (a sleeping lease keeps its copy's root) changed.
# Run ON the device: DEVICE_CMD="bash docs/results/h100-s46-2026-12-07/run.sh" bash scripts/device_run.sh
# (carry [".whl", ".devpack"]).
. scripts/device_lib.sh
device_prelude
timeout 230 python3 -m pytest -p no:cacheprovider -m gpu tests/gpu_manager -q --timeout 120 \
  -o addopts="" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/gpu_tests.log"
