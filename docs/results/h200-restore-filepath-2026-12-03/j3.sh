#!/usr/bin/env bash
# device call 3 (s24): a new batched engine's first token from the weights file (the parallel file path, page cache
# dropped) beside the artifact and the host tier, 16 GiB class
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
TMPDIR=/dev/shm timeout 420 python3 -m holdfast.main bench restore --backend cuda --weights-gib 16 --dir /tmp --trials 1 \
  --from file,artifact,host --first-token --out "$OUT/restore-ft-partial.json" --json \
  > "$OUT/restore-first-token.json" 2> "$OUT/restore-first-token.err"
echo "restore rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"; tail -5 "$OUT/restore-first-token.err"
python3 -c "
import json
o=json.load(open('$OUT/restore-first-token.json'))
print(json.dumps({k:o.get(k) for k in ('gib_s','verified','direct_io','errors','first_token','cold_starts')})[:3000])
" 2>&1 | head -40
