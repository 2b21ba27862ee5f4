#!/usr/bin/env bash
for r in $(seq 1 $1); do
  if [ $((r % 2)) = 1 ]; then order="prev new"; else order="new prev"; fi
  for k in $order; do /tmp/s26/run1.sh /tmp/wt-$k r$r-$k; done
done
echo done
