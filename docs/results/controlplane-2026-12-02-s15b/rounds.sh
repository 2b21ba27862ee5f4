#!/usr/bin/env bash
for r in 1 2 3 4 5 6 7 8; do
  if [ $((r % 2)) = 0 ]; then /tmp/cp/run1.sh /tmp/cpb r$r-base; /tmp/cp/run1.sh /tmp/cph r$r-head-plain --no-secure
  else /tmp/cp/run1.sh /tmp/cph r$r-head-plain --no-secure; /tmp/cp/run1.sh /tmp/cpb r$r-base; fi
  if [ $((r % 2)) = 1 ]; then /tmp/cp/run1.sh /tmp/cph r$r-head-sec; fi
done
echo done
