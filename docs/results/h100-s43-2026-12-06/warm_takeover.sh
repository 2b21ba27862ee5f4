#!/usr/bin/env bash
# A successor's first step with its graphs uploaded and its drain page registered before the failure (model_runner.py
# `_warm_launch`; drain.py `ready_page`, at 14a90f3, taken out again in e5b0a4c), against the state before them, on a
# GPU host; and the GPU tests of both. Ran once (docs/results/h100-s43-2026-12-06); at HEAD the drain half is gone.
# Runs ON the device, one 10-minute call:
#   bash scripts/device_bundle.sh && rm -rf .devpack && mkdir -p .devpack && tar -C .device -cJf .devpack/bin.tar.xz bin
#   run: DEVICE_CMD="bash scripts/device_warm_takeover.sh" bash scripts/device_run.sh
#        carry: [".whl", ".devpack", ".devtree"]   (.devtree/old/: the three engine files before the change)
# Writes to $OUT: host.txt, gpu_tests.log, summary.txt (each recovery run: gap p99, the successor's step 1 launch,
# its drain page's registration, ready and first token after each kill), reports.tar.xz.
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
start=$(date +%s); w=/tmp/hfw; mkdir -p "$w"
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine_batched/test_model_runner_gpu.py \
  tests/engine_batched/test_prepared_standby_gpu.py tests/engine_batched/test_drain_gpu.py > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
mkdir -p /tmp/new && cp engines/batched/{__main__,drain,model_runner}.py /tmp/new/
one() {  # label, then new or old: which three engine files
  local label=$1 which=$2
  local left=$(( ${BUDGET:-570} - ($(date +%s) - start) )); (( left < 45 )) && { echo "skip $label: ${left}s left"; return; }
  if [ "$which" = old ]; then cp .devtree/old/*.py engines/batched/; else cp /tmp/new/*.py engines/batched/; fi
  local t0=$(date +%s)
  timeout "$left" python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 \
    --streams 64 --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 \
    --no-deterministic --secure --json --weights-dir "$w" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"
  python3 - "/tmp/r-$label.json" "$label" >> /tmp/summary.txt <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["sigkill"]
except (OSError, ValueError, KeyError) as e:
    print(sys.argv[2], "no report:", e)
    sys.exit()
succ = s.get("successor") or {}
step1 = [[f.get("launch") for f in t.get("first", []) if f.get("at_step") == 1] for t in succ.get("step_times", [])]
reg = [(r.get("drain_mark_split_ms") or {}).get("register") for r in succ.get("recovery", [])]
ready = [r.get("ready_ms") for r in succ.get("recovery", [])]
first = [t.get("first token after recovery") for t in s["timeline_ms"]]
print(sys.argv[2], "gap", s.get("largest_gap_ms"), "late", s.get("late_first_token_ms"), "lost", s.get("lost"),
      "step1 launch", step1, "register", reg, "ready", ready, "first token", first)
PY
  rm -rf /tmp/holdfast-demo-*
}
for i in 1 2 3 4 5; do
  if (( i % 2 )); then one N$i new; one O$i old; else one O$i old; one N$i new; fi
done
cp /tmp/new/*.py engines/batched/
cp /tmp/summary.txt "$OUT/"
cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-*.json r-*.err 2>/dev/null
cat /tmp/summary.txt
