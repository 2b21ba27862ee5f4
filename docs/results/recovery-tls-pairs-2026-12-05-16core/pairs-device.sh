#!/usr/bin/env bash
mkdir -p .device && tar -C .device -xJf .devpack/bin.tar.xz && chmod +x .device/bin/*
# issue 20: recovery pairs secure/plain on the device host (host backend), output to $OUT
rounds=${ROUNDS:-4}; trials=${TRIALS:-8}; out=$OUT/pairs
mkdir -p "$out"; wdir=$(mktemp -d /tmp/hf-rw-XXXXXX)
nproc > "$out/host.txt"; git log --oneline -1 >> "$out/host.txt" 2>&1
for r in $(seq "${START:-1}" "$rounds"); do
  if (( r % 2 )); then order="secure plain"; else order="plain secure"; fi
  for mode in $order; do
    flag=""; [[ $mode == plain ]] && flag="--no-secure"
    t0=$(date +%s)
    HF_FORCE_NO_GPU=1 python3 -m holdfast.main bench recovery --backend host --ways standby --trials "$trials" --json --weights-dir "$wdir" \
      $flag > "$out/round$r-$mode.json" 2> "/tmp/round$r-$mode.err" || echo "round $r $mode failed: $?"
    echo "round $r $mode ($(( $(date +%s) - t0 )) s): $(python3 -c "import json,sys; d=json.load(open('$out/round$r-$mode.json')); print(d['warm_standby']['death_to_first_token_ms'])")"
  done
done
rm -rf "$wdir"
