#!/usr/bin/env bash
# Interleaved rounds, order rotated: base = a1bd35f; A = abc1c89 (before), B = 2b13691 (the fix); plain and secure.
cd /tmp/cp19
R=${1:-2}; tag=${2:-n}
kinds=(base A-plain B-plain A-sec B-sec)
for r in $(seq 1 $R); do
  for k in $(seq 0 4); do
    i=$(( (k + r - 1) % 5 )); kind=${kinds[$i]}
    case $kind in
      base) ./run1.sh /tmp/cp19-base $tag$r-$kind ;;
      A-plain) ./run1.sh /tmp/hf-head $tag$r-$kind --no-secure ;;
      B-plain) ./run1.sh /tmp/cp19-hold $tag$r-$kind --no-secure ;;
      A-sec) ./run1.sh /tmp/hf-head $tag$r-$kind ;;
      B-sec) ./run1.sh /tmp/cp19-hold $tag$r-$kind ;;
    esac
  done
done
echo done
