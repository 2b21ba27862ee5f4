#!/usr/bin/env bash
# The GPU report, run ON the device machine through scripts/device_run.sh (DEVICE_CMD): the gpu-marked
# tests, the demo, recovery side by side and a short chaos run, on the cuda backend. Every result lands in
# $OUT (JSON + logs) to be copied into docs/benchmarks.md. HF_ENGINE_GRAPHS=false in the environment runs every
# engine without CUDA graphs (on by default on CUDA: engines/reference/static_forward.py); "forward" probes the forward's cost.
#   STEPS="probe forward tail tests demo recovery8 recovery16 chaos" (default: tests demo recovery16 chaos);
#   "tail": scripts/probe_dead_tail.py on memory shared like an engine's and its shadow's (GIB_TAIL, 16; up to
#   ~120 fits one H200: one copy). GIB_BIG=48 for
#   the large recovery step "recoverybig" (MAX_SEQ_BIG: every engine's KV capacity, so that two engines' caches
#   fit beside the weights). Its one weights file lives in $TMPDIR: TMPDIR=/dev/shm where the disk is too small
#   (nvidia-h200-x2: 256 GiB of memory for GIB_BIG=120; the output then says the cold restart read from memory).
#   A 10-minute call may not hold every way of a 120 GiB run: WAYS_BIG=standby,cold then WAYS_BIG=fresh in a second
#   call on the still-warm machine, with WEIGHTS_DIR=/dev/shm/hf (the file made once, kept and reused). A call
#   cut off by its limit still brings back <step>.partial.json: every way that ended before the cut.
#   Measured 2026-11-30 (x2, 120 GiB): making the file and loading it into leases 136-178 s, a standby trial ~21 s,
#   a cold restart ~72 s, a fresh-process trial ~23 s: standby x2 + cold x2 fit one call, fresh x2 another.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-"tests demo recovery16 chaos"}
HF="python3 -m holdfast.main"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
nproc >> "$OUT/gpu.txt"; free -g | head -2 >> "$OUT/gpu.txt"; df -h / | tail -1 >> "$OUT/gpu.txt"
for step in $STEPS; do
  t0=$(date +%s)
  case $step in
    probe) python3 scripts/probe_exit.py > "$OUT/probe_exit.jsonl" 2> "$OUT/probe_exit.err" ;;
    forward) python3 scripts/probe_forward.py 1b 8b@39 70b@10 > "$OUT/probe_forward.jsonl" 2> "$OUT/probe_forward.err" ;;
    tail) python3 scripts/probe_dead_tail.py shared "${GIB_TAIL:-16}" 1 4 > "$OUT/probe_dead_tail.jsonl" 2> "$OUT/probe_dead_tail.err" ;;
    tests) python3 -m pytest -p no:cacheprovider -m gpu tests -q --timeout 300 > "$OUT/gpu_tests.log" 2>&1 ;;
    demo) $HF demo --json > "$OUT/demo.json" 2> "$OUT/demo.err" ;;
    recovery8) $HF bench recovery --backend cuda --weights-gib 8 --trials "${TRIALS:-3}" --unshadowed --json \
                  --partial "$OUT/recovery8.partial.json" \
                  > "$OUT/recovery8.json" 2> "$OUT/recovery8.err" ;;
    recovery16) $HF bench recovery --backend cuda --weights-gib 16 --trials "${TRIALS:-3}" --json \
                  --partial "$OUT/recovery16.partial.json" \
                  > "$OUT/recovery16.json" 2> "$OUT/recovery16.err" ;;
    recoverybig) $HF bench recovery --backend cuda --weights-gib "${GIB_BIG:-48}" --trials "${TRIALS_BIG:-2}" \
                  --max-seq "${MAX_SEQ_BIG:-1024}" ${WAYS_BIG:+--ways "$WAYS_BIG"} \
                  ${WEIGHTS_DIR:+--weights-dir "$WEIGHTS_DIR"} --partial "$OUT/recoverybig.partial.json" --json \
                  > "$OUT/recoverybig.json" 2> "$OUT/recoverybig.err" ;;
    chaos) $HF chaos --minutes "${CHAOS_MIN:-1}" --seed 7 --json > "$OUT/chaos.json" 2> "$OUT/chaos.err" ;;
  esac
  echo "step $step: rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
done
tail -c 3000 "$OUT"/*.err 2>/dev/null | tail -40
cat "$OUT"/*.json 2>/dev/null
