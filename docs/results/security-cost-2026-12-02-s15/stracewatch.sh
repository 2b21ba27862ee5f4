#!/usr/bin/env bash
# attach strace -c to the bench's nats-server (work dir hf-bench-cp) as soon as it appears
label=$1
for i in $(seq 1 600); do
  p=$(pgrep -f "nats-server .*hf-bench-cp" | head -1)
  if [ -n "$p" ]; then exec strace -c -f -p $p -o /tmp/s15/out/$label-nats-strace.txt; fi
  sleep 0.1
done
