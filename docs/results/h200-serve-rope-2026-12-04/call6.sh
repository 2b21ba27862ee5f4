#!/usr/bin/env bash
# device call 6 (s26): the serve table at HEAD (rope and add+norm kernels): default and deterministic mode and the
# plain torch loop, side by side in one run
set -u
OUT=${OUT:-/tmp/out}; R=$OUT/k6; mkdir -p "$R" /tmp/hfw/s
git log --oneline -1 2>/dev/null
t0=$(date +%s)
timeout 420 python3 -m holdfast.main bench serve --concurrency 1,16,64,256 --plain --both-modes --max-tokens 128 \
  --weights-dir /tmp/hfw/s > "$R/serve-both.json" 2> /tmp/serve-both.err
echo "serve rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 /tmp/serve-both.err
python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for m,rows in d['modes'].items():
    for r in rows: print(m, r['concurrency'], r.get('decode_tokens_per_s'), r.get('share_of_roofline'), r['ttft_ms'], r['itl_ms'], r['largest_gap_ms'])
print(json.dumps(d.get('plain_decode'))[:1200])
" "$R/serve-both.json"
