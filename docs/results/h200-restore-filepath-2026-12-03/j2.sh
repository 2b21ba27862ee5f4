#!/usr/bin/env bash
# device call 2 (s24): restore peers on the same file with fastsafetensors (wheel carried), 4 interleaved trials;
# the gpu-marked tests of tests/engine_batched, tests/engine, tests/e2e (cold loads through the new file path)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import fastsafetensors, sys; print('fastsafetensors', fastsafetensors.__file__)" 2>&1 | tee "$OUT/fst.txt"
t0=$(date +%s)
TMPDIR=/dev/shm timeout 300 python3 -m holdfast.main bench restore --backend cuda --weights-gib 16 --dir /tmp --trials 4 \
  --from file,fastsafetensors,artifact --no-first-token --out "$OUT/restore-partial.json" --json \
  > "$OUT/restore-peers.json" 2> "$OUT/restore-peers.err"
echo "restore rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"; tail -3 "$OUT/restore-peers.err"
python3 -c "
import json
o=json.load(open('$OUT/restore-peers.json'))
print(json.dumps({k:o.get(k) for k in ('gib_s','trials_s','verified','direct_io','errors','skipped','goals')}))
" 2>&1 | head -40
t0=$(date +%s)
timeout 240 python3 -m pytest -p no:cacheprovider -m gpu tests/engine_batched tests/engine tests/e2e -q --timeout 150 \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"; tail -12 "$OUT/gpu_tests.log"
