#!/usr/bin/env bash
# device call (s28): recovery 64 + 16 (fast mode, 3 kills), the session's start (183a31a) and head alternated on one
# host; then the gpu tests of the gpu_manager and the client (changed this session) at the head
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw/w
mkdir -p .device && tar xzf .devpack/device-bin.tgz -C .device && chmod +x .device/bin/*
export PATH=$PWD/.device/bin:$PATH
ROOT=$PWD
rec() {  # name tree
  cd $ROOT/.devtree/$2
  local t0=$(date +%s)
  PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 --streams 64 --late 16 \
    --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 --no-deterministic --drawn-weights \
    --weights-dir /tmp/hfw/w --json > "$OUT/rec-$1.json" 2> /tmp/rec.err
  echo "recovery $1 rc=$? in $(( $(date +%s) - t0 )) s"
  python3 - "$OUT/rec-$1.json" "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d["sigkill"]
print(sys.argv[2], "gap", s["largest_gap_ms"]["p50"], s["largest_gap_ms"]["p99"], "late", s["late_first_token_ms"]["p50"],
      s["late_first_token_ms"]["p99"], "ready", [r["ready_ms"] for r in s["successor"]["recovery"]], "lost", s["lost"],
      "control gap", d["no_failure"]["largest_gap_ms"]["p99"])
PY
}
rec prev1 prev; rec now1 now; rec prev2 prev; rec now2 now
cd $ROOT/.devtree/now
t0=$(date +%s)
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/gpu_manager tests/client -q --timeout 120 \
  --continue-on-collection-errors > "$OUT/gpu_tests_manager.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/gpu_tests_manager.log"
