#!/usr/bin/env bash
# Interleaved rounds, order rotated: base = a1bd35f; head = ab6cfc2 (before this pass); new = this pass; plain = --no-secure.
cd /tmp/cp20
R=${1:-3}; tag=${2:-r}
kinds=(base head-plain new-plain new-sec)
for r in $(seq 1 $R); do
  for k in 0 1 2 3; do
    i=$(( (k + r - 1) % 4 )); kind=${kinds[$i]}
    case $kind in
      base) ./run1.sh /tmp/cp20-base $tag$r-$kind ;;
      head-plain) ./run1.sh /tmp/cp20-head $tag$r-$kind --no-secure ;;
      new-plain) ./run1.sh /tmp/cp20-new $tag$r-$kind --no-secure ;;
      new-sec) ./run1.sh /tmp/cp20-new $tag$r-$kind ;;
    esac
  done
done
echo done
