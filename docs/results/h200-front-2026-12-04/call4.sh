#!/usr/bin/env bash
# device call 4 (s27): a flood of bad requests (2,000 contexts too long, 400 each) while 64 streams decode: the HTTP
# front (now) vs HTTP on a thread of the engine (e43d673's engines/), alternated; 8b recovery 64 + 16 in
# deterministic mode (mismatched), 3 kills; the served table (both modes, the plain loop) with the front
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw/s /tmp/hfw/w
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
summ() {
python3 - "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, rows in d['modes'].items():
    for r in rows:
        print(sys.argv[2], m, r['concurrency'], 'decode', r.get('decode_tokens_per_s'), 'itl', r['itl_ms'].get('p50'),
              r['itl_ms'].get('p99'), r['itl_ms'].get('max'), 'gap', r['largest_gap_ms'].get('p50'), r['largest_gap_ms'].get('max'),
              'burst', r.get('burst'), 'step', r.get('engine_step_ms'))
for p in d.get('plain_decode') or []:
    print(sys.argv[2], 'plain', p)
PY
}
serve() {  # name pythonpath args...
  local name=$1 pp=$2; shift 2; local t0=$(date +%s)
  PYTHONPATH=$pp timeout 200 python3 -m holdfast.main bench serve --drawn-weights --weights-dir /tmp/hfw/s "$@" \
    > "$OUT/serve-$name.json" 2> "/tmp/serve-$name.err"
  echo "serve $name rc=$? in $(( $(date +%s) - t0 )) s"; tail -1 "/tmp/serve-$name.err" | cut -c1-200; summ "$OUT/serve-$name.json" "$name" 2>&1 | tail -9
}
NOW=$PYTHONPATH; PREV=/tmp/site:$PWD/.devtree/prevtree:$PWD
B="--concurrency 64 --max-tokens 384 --burst 2000"
serve burst-front1 "$NOW" $B; serve burst-thread1 "$PREV" $B; serve burst-front2 "$NOW" $B; serve burst-thread2 "$PREV" $B
t0=$(date +%s)
timeout 200 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 \
  --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$OUT/rec-det.json" 2> /tmp/rec-det.err
echo "recovery det rc=$? in $(( $(date +%s) - t0 )) s"; tail -2 /tmp/rec-det.err | cut -c1-300
python3 .devtree/an.py "$OUT/rec-det.json" 2>&1 | grep -v "^ T\|^     \|phases" | head -10
serve table "$NOW" --concurrency 1,16,64,256 --max-tokens 256 --both-modes --plain
