#!/usr/bin/env bash
# device call 7 (s26): where the engine process's time goes serving 256 streams (py-spy, every thread, 200 Hz)
set -u
OUT=${OUT:-/tmp/out}; R=$OUT/k7; mkdir -p "$R" /tmp/hfw/s
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .devtree/pyspy/*.whl 2>&1 | tail -1
SPY=/tmp/pyspy/bin/py-spy
python3 -m holdfast.main bench serve --concurrency 4,256 --max-tokens 1024 --weights-dir /tmp/hfw/s \
  > /tmp/serve7.json 2> /tmp/serve7.err &
bench=$!
for i in $(seq 1 240); do
  grep -q '"concurrency": 4' /tmp/serve7.err 2>/dev/null && break; sleep 0.5
done
pid=$(pgrep -f "engines.batched" | head -1)
echo "engine pid $pid after $i polls"
sleep 3
timeout 30 $SPY record -p "$pid" -d 8 -r 200 --threads --nonblocking --format raw -o "$R/spy-256.txt" > /tmp/spy.log 2>&1
echo "py-spy rc=$?"; tail -3 /tmp/spy.log
timeout 30 $SPY dump -p "$pid" > "$R/dump.txt" 2>&1
wait $bench
echo "serve rc=$?"; tail -2 /tmp/serve7.err | cut -c1-600
