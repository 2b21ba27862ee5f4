#!/usr/bin/env bash
cd /tmp/s15
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then ./run1.sh /tmp/s15/wt-base f$r-sec; ./run1.sh /tmp/s15/wt-base f$r-plain --no-secure
  else ./run1.sh /tmp/s15/wt-base f$r-plain --no-secure; ./run1.sh /tmp/s15/wt-base f$r-sec; fi
done
echo done
