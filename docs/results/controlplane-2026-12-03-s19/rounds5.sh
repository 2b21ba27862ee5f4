#!/usr/bin/env bash
# rounds5.sh TAG FIRST LAST: interleaved rounds of base (a1bd35f), h0 (the session's start, 1681ba7) plain and
# secure, h1 (d0b0c5b) plain and secure; the order rotated by one each round; each run one burst of 8,000 at
# 1,000 x 8 (run1.sh) from its own worktree.
tag=$1
cd /tmp/s19
kinds=(base h1-plain h0-sec h1-sec h0-plain)
for r in $(seq $2 $3); do
  for i in 0 1 2 3 4; do
    k=${kinds[$(( (i + r) % 5 ))]}
    case $k in
      base) ./run1.sh /tmp/wt-base $tag$r-base;;
      h0-plain) ./run1.sh /tmp/wt-h0 $tag$r-h0-plain --no-secure;;
      h0-sec) ./run1.sh /tmp/wt-h0 $tag$r-h0-sec;;
      h1-plain) ./run1.sh /tmp/wt-h1 $tag$r-h1-plain --no-secure;;
      h1-sec) ./run1.sh /tmp/wt-h1 $tag$r-h1-sec;;
    esac
  done
done
echo done
