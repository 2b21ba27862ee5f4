#!/usr/bin/env bash
# Runs ON the GPU device machine (from the repo root, with .whl and .device carried):
#   scripts/device_run.sh [pytest args...]      e.g. scripts/device_run.sh -m gpu tests/gpu_manager
#   DEVICE_CMD="python3 -m ..." scripts/device_run.sh   run another command in the same environment
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.device/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
chmod +x .device/bin/* 2>/dev/null || true
# A call cut off by its time limit leaves its stack running on a machine still warm (2026-11-30: a gpu_manager
# holding 127 GiB of the GPU made the next call's first allocation fail). Every process a call starts inherits
# its run id (HOLDFAST_DEVICE_RUN, detached ones too): the previous call's processes, and only those, are ended
# here by their pids.
RUN_ID_FILE=/tmp/holdfast-device-run.id
if [ -f "$RUN_ID_FILE" ]; then
  python3 -c "import sys; from libs.common import procs; print('ended', procs.kill_pids_with_env('HOLDFAST_DEVICE_RUN', sys.argv[1]))" \
    "$(cat "$RUN_ID_FILE")" || true
fi
export HOLDFAST_DEVICE_RUN="run-$$-$(date +%s%N)"
echo "$HOLDFAST_DEVICE_RUN" > "$RUN_ID_FILE"
if [ -n "${DEVICE_CMD:-}" ]; then
  exec bash -c "$DEVICE_CMD"
fi
exec python3 -m pytest -p no:cacheprovider "$@"
