#!/usr/bin/env bash
# Recovery under load at the 120 GiB class on an H200 (141 GB): 119.5 GiB of bf16 weights in 70B-wide layers, drawn
# on the GPU at the cold load from a header-only file (--drawn-weights: the device's RAM and disk cannot hold the
# file), a 6 GiB KV cache, 64 streams + 16 late, 3 SIGKILLs; fast mode, then deterministic, then fast again.
# Runs ON the device, one 10-minute call (needs_h200):
#   bash scripts/device_bundle.sh && rm -rf .devpack && mkdir -p .devpack && tar -C .device -cJf .devpack/bin.tar.xz bin
#   run: DEVICE_CMD="bash scripts/device_recovery_120.sh" bash scripts/device_run.sh   carry: [".whl", ".devpack"]
# Writes to $OUT: host.txt, summary.txt (scripts/device_lib.sh), reports.tar.xz.
. scripts/device_lib.sh
device_prelude
big="--weights-gib 120 --drawn-weights --kv-cache-gib 6"
RECOVERY_ARGS="$big --no-deterministic" recovery_one F1
RECOVERY_ARGS="$big --deterministic" recovery_one D1
RECOVERY_ARGS="$big --no-deterministic" recovery_one F2
device_finish
