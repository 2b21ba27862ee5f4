#!/usr/bin/env bash
# Death marks (services/agent/mark_waiter.py) against the PF_EXITING poll alone, on a GPU host: do they see a
# death sooner there without the 2-core machine's later p99 (docs/benchmarks.md "Failure detection")?
# Runs ON the device, one 10-minute call:
#   bash scripts/device_bundle.sh && rm -rf .devpack && mkdir -p .devpack && tar -C .device -cJf .devpack/bin.tar.xz bin
#   run: DEVICE_CMD="bash scripts/device_death_marks.sh" bash scripts/device_run.sh   carry: [".whl", ".devpack"]
# Writes to $OUT: host.txt, detect.json (60 kills a way, engines holding 256 MiB of host memory), summary.txt
# (each recovery run: gap p99, the timeline's `detected` and first token after the kill), reports.tar.xz.
. scripts/device_lib.sh
device_prelude
# ~1 s a kill on an H100 host, both ways (2026-12-06): 60 kills a way in ~2 minutes
timeout 200 python3 -m holdfast.main bench detect --kills 60 --json > "$OUT/detect.json" 2> /tmp/detect.err
tail -c 400 /tmp/detect.err
for i in 1 2 3 4 5 6; do
  if (( i % 2 )); then recovery_one M$i HF_DEATH_MARKS=true; recovery_one P$i HF_DEATH_MARKS=false
  else recovery_one P$i HF_DEATH_MARKS=false; recovery_one M$i HF_DEATH_MARKS=true; fi
done
device_finish
