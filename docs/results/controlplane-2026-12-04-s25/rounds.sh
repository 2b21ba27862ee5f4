#!/usr/bin/env bash
# rounds.sh TAG FIRST LAST HEADDIR: interleaved rounds of base (a1bd35f) / head-plain (--no-secure) / head-sec,
# order rotated per round; each run one burst of 8,000 at 1,000 x 8 (run1.sh) from its own worktree.
tag=$1; head=$4
cd /tmp/s25
for r in $(seq $2 $3); do
  case $((r % 3)) in
    1) order="base head-plain head-sec";;
    2) order="head-plain head-sec base";;
    0) order="head-sec base head-plain";;
  esac
  for k in $order; do
    case $k in
      base) ./run1.sh /tmp/wt-base $tag$r-base;;
      head-plain) ./run1.sh $head $tag$r-head-plain --no-secure;;
      head-sec) ./run1.sh $head $tag$r-head-sec;;
    esac
  done
done
echo done
