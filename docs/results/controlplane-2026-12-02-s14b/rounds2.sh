#!/usr/bin/env bash
# More interleaved pairs, order alternated: base = a1bd35f, head-plain = today's HEAD --no-secure.
cd /tmp/cp21
for r in 4 5 6 7 8; do
  if [ $((r % 2)) = 0 ]; then ./run1.sh /tmp/cp21-base r$r-base; ./run1.sh /tmp/cp21-head r$r-head-plain --no-secure
  else ./run1.sh /tmp/cp21-head r$r-head-plain --no-secure; ./run1.sh /tmp/cp21-base r$r-base; fi
done
echo done
