#!/usr/bin/env bash
# pairs.sh FIRST LAST: interleaved pairs head (HEAD before the change, /tmp/cp-head) vs new (/tmp/cp-new), order alternated
for r in $(seq $1 $2); do
  if [ $((r % 2)) = 1 ]; then order="head new"; else order="new head"; fi
  for k in $order; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    (cd /tmp/cp-$k && flock /tmp/hf-bench.lock nice -n -10 timeout 600 /work/main/.venv/bin/python /tmp/cp15/measure.py r$r-$k --no-secure > /tmp/cp15/res/r$r-$k.log 2>&1)
    cp /tmp/cp15/out/r$r-$k.json /tmp/cp15/res/ 2>/dev/null
    echo "r$r-$k load=$load $(grep inc/s /tmp/cp15/res/r$r-$k.log)"
  done
done
