#!/usr/bin/env bash
# device call 3 (s28): deterministic mode's one-token tile (64 / 128 / 256) against the default mode: the runner's
# decode step at 8b@8; served 8b, both modes with --deterministic-tile 256, then deterministic with the default tile
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw/s
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
export PATH=$PWD/.device/bin:$PATH
cd .devtree/now
export PYTHONPATH=/tmp/site:$PWD
summ() {
python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, rows in d['modes'].items():
    for r in rows:
        print(m, r['concurrency'], 'decode', r.get('decode_tokens_per_s'), 'itl', r['itl_ms'].get('p50'), r['itl_ms'].get('p99'), 'ttft', r.get('ttft_ms', {}).get('p50'), r.get('ttft_ms', {}).get('p99'))
PY
}
t0=$(date +%s)
timeout 260 python3 -m holdfast.main bench serve --drawn-weights --weights-dir /tmp/hfw/s --concurrency 1,16,64,256 \
  --max-tokens 256 --both-modes --engine-args "--deterministic-tile 256" > $OUT/serve-tile256.json 2>/tmp/s1.err
echo "serve tile256 rc=$? $(( $(date +%s) - t0 )) s"; grep -v '^ *$' /tmp/s1.err | head -20 | cut -c1-200; summ $OUT/serve-tile256.json
t0=$(date +%s)
timeout 150 python3 -m holdfast.main bench serve --drawn-weights --weights-dir /tmp/hfw/s --concurrency 1,16,64,256 \
  --max-tokens 256 --deterministic > $OUT/serve-tile64.json 2>/tmp/s2.err
echo "serve det tile64 rc=$? $(( $(date +%s) - t0 )) s"; grep -v '^ *$' /tmp/s2.err | head -20 | cut -c1-200; summ $OUT/serve-tile64.json
