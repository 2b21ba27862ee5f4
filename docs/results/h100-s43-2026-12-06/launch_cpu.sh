mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
w=/tmp/hfw; mkdir -p "$w"; nvidia-smi --query-gpu=name --format=csv,noheader; nproc
for i in 1 2 3; do
  timeout 150 python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 \
    --streams 64 --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 \
    --no-deterministic --secure --json --weights-dir "$w" > "$OUT/c$i.json" 2> "/tmp/c$i.err"
  echo "run $i rc=$?"
  python3 - "$OUT/c$i.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["sigkill"]
succ = s.get("successor") or {}
for t in succ.get("step_times", []):
    print([(f["at_step"], f.get("launch"), round(f.get("launch_cpu", -1), 2), f.get("schedule"), f.get("rows"), f.get("prefill_tokens")) for f in t.get("first", [])[:2]])
print("gap", s.get("largest_gap_ms"), "stalls", [r.get("stalls") for r in succ.get("recovery", [])])
PY
  rm -rf /tmp/holdfast-demo-*
done
