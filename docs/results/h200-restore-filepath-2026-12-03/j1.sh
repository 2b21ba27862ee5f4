#!/usr/bin/env bash
# device call 1 (s24): restore peers on the same file, 4 interleaved trials (file path now parallel direct reads);
# the gpu-marked tests of tests/client and tests/gpu_manager
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
df -h /tmp > "$OUT/df.txt" 2>&1; nproc >> "$OUT/df.txt"
t0=$(date +%s)
TMPDIR=/dev/shm timeout 330 python3 -m holdfast.main bench restore --backend cuda --weights-gib 16 --dir /tmp --trials 4 \
  --from file,fastsafetensors,artifact --no-first-token --out "$OUT/restore-partial.json" --json \
  > "$OUT/restore-peers.json" 2> "$OUT/restore-peers.err"
echo "restore rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"; tail -3 "$OUT/restore-peers.err"
python3 -c "
import json,sys
o=json.load(open('$OUT/restore-peers.json'))
print(json.dumps({k:o.get(k) for k in ('gib_s','trials_s','verified','direct_io','errors','goals')}, indent=1))
" 2>&1 | head -80
t0=$(date +%s)
timeout 200 python3 -m pytest -p no:cacheprovider -m gpu tests/client tests/gpu_manager -q --timeout 150 \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"; tail -12 "$OUT/gpu_tests.log"
