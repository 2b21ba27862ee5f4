# Shared by the device scripts that compare recovery runs (sourced ON the device, from the repo root, $OUT set):
#   device_prelude               unpack the bundle's binaries, note the host in $OUT/host.txt, start the clock
#   recovery_one LABEL [VAR=v]   one recovery run with those variables set, one line of it appended to the summary:
#                                64 streams + 16 late, 3 SIGKILLs, secure, and $RECOVERY_ARGS (default: the 8b-shaped
#                                13 GiB model, fast mode)
#   device_finish                summary.txt and reports.tar.xz into $OUT
# A run is skipped when less than 45 s of ${BUDGET:-570} is left (one call may run 10 minutes).
device_prelude() {
  mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
  start=$(date +%s); w=/tmp/hfw; mkdir -p "$w"; : > /tmp/summary.txt
  nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/host.txt"; nproc >> "$OUT/host.txt"
}

recovery_one() {
  local label=$1; shift
  local left=$(( ${BUDGET:-570} - ($(date +%s) - start) )); (( left < 45 )) && { echo "skip $label: ${left}s left"; return; }
  local t0=$(date +%s)
  env "$@" timeout "$left" python3 -m holdfast.main bench recovery --backend cuda \
    --streams 64 --late 16 --trials 3 --max-tokens 96 --step-tokens 512 --prefill-chunk 128 --secure --json \
    ${RECOVERY_ARGS:---weights-gib 13 --kv-cache-gib 16 --no-deterministic} --weights-dir "$w" > "/tmp/r-$label.json" 2> "/tmp/r-$label.err"
  echo "$label rc=$? in $(( $(date +%s) - t0 )) s"
  python3 - "/tmp/r-$label.json" "$label" >> /tmp/summary.txt <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["sigkill"]
except (OSError, ValueError, KeyError) as e:
    print(sys.argv[2], "no report:", e)
    sys.exit()
succ = s.get("successor") or {}
step1 = [[(f.get("launch"), f.get("launch_cpu")) for f in t.get("first", []) if f.get("at_step") == 1]
         for t in succ.get("step_times", [])]
marks = [(t.get("detected"), t.get("successor assigned"), t.get("first token after recovery")) for t in s["timeline_ms"]]
print(sys.argv[2], "gap", s.get("largest_gap_ms"), "late", s.get("late_first_token_ms"), "lost", s.get("lost"),
      "recomputed", succ.get("recomputed_prefill_tokens"), "step1 launch/cpu", step1,
      "ready", [r.get("ready_ms") for r in succ.get("recovery", [])],
      "detected/assigned/first token", marks, "seen", s.get("detected_as"))
PY
  rm -rf /tmp/holdfast-demo-*
}

device_finish() {
  cp /tmp/summary.txt "$OUT/"
  (cd /tmp && tar -cJf "$OUT/reports.tar.xz" r-*.json r-*.err 2>/dev/null)
  cat /tmp/summary.txt
}
