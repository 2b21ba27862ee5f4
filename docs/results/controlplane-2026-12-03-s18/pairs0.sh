#!/usr/bin/env bash
# pairs0.sh FIRST LAST: head0 (bfb76b0, this session's start) against head (this session's commits), plain and
# secure, order alternated; attributes the change within each pair.
cd /tmp/s18
for r in $(seq $1 $2); do
  if [ $((r % 2)) = 1 ]; then
    ./run1.sh /tmp/cp-head0 p$r-head0-plain --no-secure; ./run1.sh /tmp/cp-head p$r-head-plain --no-secure
    ./run1.sh /tmp/cp-head p$r-head-sec; ./run1.sh /tmp/cp-head0 p$r-head0-sec
  else
    ./run1.sh /tmp/cp-head p$r-head-plain --no-secure; ./run1.sh /tmp/cp-head0 p$r-head0-plain --no-secure
    ./run1.sh /tmp/cp-head0 p$r-head0-sec; ./run1.sh /tmp/cp-head p$r-head-sec
  fi
done
echo done
