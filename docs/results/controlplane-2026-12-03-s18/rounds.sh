#!/usr/bin/env bash
# rounds.sh FIRST LAST: interleaved rounds of base (a1bd35f) / head-plain (--no-secure) / head-sec, order rotated
# per round; each run is one burst of 8,000 at 1,000 x 8 (run1.sh) from its own worktree.
cd /tmp/s18
for r in $(seq $1 $2); do
  case $((r % 3)) in
    1) order="base head-plain head-sec";;
    2) order="head-plain head-sec base";;
    0) order="head-sec base head-plain";;
  esac
  for k in $order; do
    case $k in
      base) ./run1.sh /tmp/cp-base r$r-base;;
      head-plain) ./run1.sh /tmp/cp-head r$r-head-plain --no-secure;;
      head-sec) ./run1.sh /tmp/cp-head r$r-head-sec;;
    esac
  done
done
echo done
