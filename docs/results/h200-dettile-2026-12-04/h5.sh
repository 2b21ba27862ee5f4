#!/usr/bin/env bash
# device call (s28, final): every gpu-marked test at the session's head; then served 8b at 64 and 256 streams and
# recovery 64 + 16 (fast mode, 3 kills) as a check that the session's HTTP changes cost the hot path nothing
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw/s /tmp/hfw/w
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
export PATH=$PWD/.device/bin:$PATH
cd .devtree/now
export PYTHONPATH=/tmp/site:$PWD
t0=$(date +%s)
timeout 330 python3 -m pytest -p no:cacheprovider -m gpu tests -q --timeout 240 --continue-on-collection-errors > "$OUT/gpu_tests_all.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -8 "$OUT/gpu_tests_all.log"
t0=$(date +%s)
timeout 100 python3 -m holdfast.main bench serve --drawn-weights --weights-dir /tmp/hfw/s --concurrency 64,256 \
  --max-tokens 256 > $OUT/serve.json 2>/tmp/s.err
echo "serve rc=$? $(( $(date +%s) - t0 )) s"; grep '"mode"' /tmp/s.err | cut -c1-230
t0=$(date +%s)
timeout 130 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 \
  --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic --drawn-weights \
  --weights-dir /tmp/hfw/w --json > "$OUT/recovery.json" 2> /tmp/rec.err
echo "recovery rc=$? in $(( $(date +%s) - t0 )) s"; tail -2 /tmp/rec.err | cut -c1-300
python3 - "$OUT/recovery.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("no_failure", "sigkill"):
    s = d[k]
    print(k, "gap", s["largest_gap_ms"], "late", s["late_first_token_ms"], "lost", s["lost"], "recomputed",
          s.get("successor", {}).get("recomputed_prefill_tokens"))
PY
