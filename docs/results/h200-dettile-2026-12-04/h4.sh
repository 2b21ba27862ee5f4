#!/usr/bin/env bash
# device call 6 (s28): TP=2 with both ranks on the one GPU over gloo (--tp-one-gpu)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
export PATH=$PWD/.device/bin:$PATH
cd .devtree/now
export PYTHONPATH=/tmp/site:$PWD
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine_batched/test_tp_gang_gpu.py 2>&1 | tail -30 | tee $OUT/tp_gang_gpu.log
