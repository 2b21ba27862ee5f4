#!/usr/bin/env bash
# Quiet-machine pairs: HEAD (A) vs HEAD + this change (B), both --no-secure, order rotated.
set -u
OUT=/tmp/s12b-out/pairs; mkdir -p $OUT
run() { # $1 run number $2 A|B
  local dir=/tmp/s12b-head
  [ "$2" = B ] && dir=/tmp/s12b-new
  local load; load=$(cut -d' ' -f1-3 /proc/loadavg)
  (cd $dir && timeout 600 /work/main/.venv/bin/python -m holdfast.main bench controlplane --nodes 1000 --gpus-per-node 8 --incidents 8000 --json --no-secure > $OUT/r$1-$2.json 2> $OUT/r$1-$2.err)
  echo "r$1 $2 $(git -C $dir rev-parse --short HEAD) load_before=$load rc=$?" >> $OUT/log
}
i=${START:-0}
for order in ${ROUNDS:-AB BA AB BA}; do  # each round: two runs, in the order given
  for k in ${order:0:1} ${order:1:1}; do i=$((i+1)); run $(printf %02d $i) $k; done
done
echo done >> $OUT/log
