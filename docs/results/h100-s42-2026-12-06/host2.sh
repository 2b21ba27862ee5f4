mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
start=$(date +%s); w=/tmp/hfw; mkdir -p "$w"; unset HF_DEATH_MARKS
for i in 1 2 3 4 5 6; do
  left=$(( 190 - ($(date +%s) - start) )); (( left < 40 )) && break
  timeout "$left" python3 -m holdfast.main bench recovery --backend cuda --weights-gib 13 \
    --streams 64 --late 16 --trials 3 --max-tokens 96 --kv-cache-gib 16 --step-tokens 512 --prefill-chunk 128 \
    --no-deterministic --secure --json --weights-dir "$w" > "$OUT/r-D$i.json" 2> "$OUT/r-D$i.err"
  echo "D$i rc=$?"
  python3 -c "
import json,sys
s=json.load(open(sys.argv[1]))['sigkill']
print(sys.argv[2],'gap',s['largest_gap_ms'],'late',s['late_first_token_ms'].get('p99'),'lost',s.get('lost'),s.get('detected_as'),[(t.get('detected'),t.get('successor assigned'),t.get('first token after recovery')) for t in s['timeline_ms']])
" "$OUT/r-D$i.json" D$i
  rm -rf /tmp/holdfast-demo-*
done
