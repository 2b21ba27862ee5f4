#!/usr/bin/env bash
# device call 1 (s27): 64 + 256 streams served, the HTTP thread on asyncio/h11 vs uvloop/httptools (same code),
# the step thread's per-step host figures (engine_step_ms), a GIL-holder profile at 256, the plain loop
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/hfw
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .devtree/pyspy/*.whl 2>&1 | tail -1
SPY=/tmp/pyspy/bin/py-spy
python3 -c "import uvloop, httptools; print('uvloop', uvloop.__version__, 'httptools', httptools.__version__)"
summ() {
python3 - "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, rows in d['modes'].items():
    for r in rows:
        print(sys.argv[2], m, r['concurrency'], 'decode', r.get('decode_tokens_per_s'), 'roof', r.get('share_of_roofline'),
              'itl', r['itl_ms'].get('p50'), r['itl_ms'].get('p99'), 'ttft', r['ttft_ms'].get('p50'), r['ttft_ms'].get('p99'),
              'step', r.get('engine_step_ms'), 'client', r['client']['cpu_share'])
for p in d.get('plain_decode') or []:
    print(sys.argv[2], 'plain', p)
PY
}
off() { mv /tmp/site/uvloop /tmp/site/_uvloop_off; mv /tmp/site/httptools /tmp/site/_httptools_off; }
on() { mv /tmp/site/_uvloop_off /tmp/site/uvloop; mv /tmp/site/_httptools_off /tmp/site/httptools; }
run() {  # name extra...
  local name=$1; shift; local t0=$(date +%s)
  timeout 240 python3 -m holdfast.main bench serve --concurrency 64,256 --drawn-weights --weights-dir /tmp/hfw "$@" \
    > "$OUT/serve-$name.json" 2> "/tmp/serve-$name.err"
  echo "serve $name rc=$? in $(( $(date +%s) - t0 )) s"; summ "$OUT/serve-$name.json" "$name" 2>&1 | tail -4
}
off; run A-asyncio --max-tokens 256; on
t0=$(date +%s)
timeout 300 python3 -m holdfast.main bench serve --concurrency 64,256 --drawn-weights --weights-dir /tmp/hfw --max-tokens 512 \
  --plain > "$OUT/serve-B-uvloop.json" 2> /tmp/serve-B.err &
bench=$!
for i in $(seq 1 400); do grep -q '"concurrency": 64' /tmp/serve-B.err 2>/dev/null && break; sleep 0.25; done
pid=$(pgrep -f "engines.batched" | head -1); echo "engine $pid after $i polls"; sleep 2
timeout 20 $SPY record -p "$pid" -d 5 -r 200 --threads --gil --nonblocking --format raw -o "$OUT/spy-gil-256.txt" > /tmp/spy.log 2>&1
echo "py-spy rc=$?"; tail -2 /tmp/spy.log
wait $bench; echo "serve B rc=$? in $(( $(date +%s) - t0 )) s"; summ "$OUT/serve-B-uvloop.json" B-uvloop
off; run C-asyncio --max-tokens 256; on
run D-uvloop --max-tokens 256
