#!/usr/bin/env bash
# device call 5 (s27): every gpu-marked test at the session's head (the HTTP front in every engine)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
t0=$(date +%s)
timeout 540 python3 -m pytest -p no:cacheprovider -m gpu tests -q --timeout 300 --continue-on-collection-errors > "$OUT/gpu_tests_all.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -6 "$OUT/gpu_tests_all.log"
